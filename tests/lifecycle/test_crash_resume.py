"""Resume after a crash between two operations repeats nothing (R2, R10)."""

from __future__ import annotations

import json
import signal
import sys
import textwrap
from pathlib import Path

import anyio

import stopline

WORKER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import anyio, stopline

    ledger_url, effects_path, stage = sys.argv[1], Path(sys.argv[2]), sys.argv[3]

    @stopline.tool
    async def send(ctx: stopline.CallContext, what: str) -> str:
        # the provider's own durable record, idempotent by key
        done = {}
        if effects_path.exists():
            for line in effects_path.read_text().splitlines():
                record = json.loads(line)
                done[record["key"]] = record
        if ctx.key not in done:
            with effects_path.open("a") as f:
                f.write(json.dumps({"key": ctx.key, "what": what}) + "\\n")
        return f"sent {what}"

    @send.verifier
    async def _(ctx: stopline.CallContext) -> stopline.Verdict:
        keys = [json.loads(line)["key"] for line in effects_path.read_text().splitlines()]
        return stopline.Verdict.COMMITTED if ctx.key in keys else stopline.Verdict.NOT_COMMITTED

    async def main() -> None:
        # strict: a call returns once its outcome is durable (the default lets the
        # outcome ride the next commit; see test_a_crash_while_an_outcome_is_recording)
        strict = stage != "window"
        async with stopline.open(ledger_url, durable_outcomes=strict, tools=[send]) as ledger:
            async with ledger.run("mail", owner="user:1", run_id="run-crash") as run:
                print(await run.call(send, "first"), flush=True)
                if stage in ("crash", "window"):
                    print("between", flush=True)
                    await anyio.sleep_forever()  # SIGKILL lands here
                print(await run.call(send, "second"), flush=True)

    anyio.run(main)
""")


async def _kill_between(tmp_path: Path, url: str, stage: str) -> tuple[list[str], list[str]]:
    """Run the worker to "between", SIGKILL it, resume in a new process.

    Returns the resumed worker's lines and the keys of the provider's effects."""
    script, effects = tmp_path / "worker.py", tmp_path / "effects.jsonl"
    await anyio.Path(script).write_text(WORKER)
    async with await anyio.open_process(
        [sys.executable, str(script), url, str(effects), stage]
    ) as worker:
        assert worker.stdout is not None
        seen = b""
        while b"between" not in seen:
            seen += await worker.stdout.receive()
        worker.send_signal(signal.SIGKILL)
        await worker.wait()
    assert worker.returncode == -signal.SIGKILL
    restarted = await anyio.run_process(
        [sys.executable, str(script), url, str(effects), "resume"], check=True
    )
    text = await anyio.Path(effects).read_text()
    keys = [json.loads(line)["key"] for line in text.splitlines()]
    return restarted.stdout.decode().splitlines(), keys


async def test_resume_after_a_crash_between_two_operations(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    lines, keys = await _kill_between(tmp_path, url, "crash")  # between the two operations
    assert lines == ["sent first", "sent second"]
    assert keys == ["run-crash/1:send", "run-crash/2:send"]  # each effect exactly once

    async with stopline.open(url) as ledger:
        receipt = await ledger.receipt("run-crash")
        events = await ledger.backend.events("run-crash")
    assert [line.status for line in receipt.lines] == [stopline.OpStatus.COMMITTED] * 2
    assert [e.kind for e in events].count("gate_passed") == 2  # the replay passed no gate again


async def test_a_crash_while_an_outcome_is_recording(tmp_path: Path) -> None:
    """The default: a call returns before its outcome commits (ADR 0022). A crash in that
    window leaves the first operation ``requested``; recovery makes it ``unknown``, the
    read-back proves it committed, and the resumed run repeats nothing (R2, R5, R10)."""
    # a group-commit window far longer than the test: the outcome cannot commit first
    url = f"sqlite:///{tmp_path / 'ledger.db'}?group_commit_ms=60000"
    lines, keys = await _kill_between(tmp_path, url, "window")  # the outcome is recording
    # proven committed by the read-back, so never sent again; its result was in the
    # lost window, so the replay has none to return (strict mode keeps it: ADR 0022)
    assert lines == ["None", "sent second"]
    assert keys == ["run-crash/1:send", "run-crash/2:send"]  # each effect exactly once
    async with stopline.open(url) as ledger:
        receipt = await ledger.receipt("run-crash")
        first = await ledger.backend.get_operation("run-crash/1:send")
    assert [line.status for line in receipt.lines] == [stopline.OpStatus.COMMITTED] * 2
    kinds = [e.kind for e in first.evidence]
    assert kinds[-2:] == [stopline.EvidenceKind.LOCAL, stopline.EvidenceKind.READ_BACK]
    assert first.evidence[-2].ref == "crash"  # what recovery saw, then what the read-back proved
