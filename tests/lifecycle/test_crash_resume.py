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

    async def main() -> None:
        async with stopline.open(ledger_url) as ledger:
            async with ledger.run("mail", owner="user:1", run_id="run-crash") as run:
                print(await run.call(send, "first"), flush=True)
                if stage == "crash":
                    print("between", flush=True)
                    await anyio.sleep_forever()  # SIGKILL lands here
                print(await run.call(send, "second"), flush=True)

    anyio.run(main)
""")


async def test_resume_after_a_crash_between_two_operations(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    effects = tmp_path / "effects.jsonl"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    async with await anyio.open_process(
        [sys.executable, str(script), url, str(effects), "crash"]
    ) as worker:
        assert worker.stdout is not None
        seen = b""
        while b"between" not in seen:
            seen += await worker.stdout.receive()
        worker.send_signal(signal.SIGKILL)  # between the two operations
        await worker.wait()
    assert worker.returncode == -signal.SIGKILL
    restarted = await anyio.run_process(
        [sys.executable, str(script), url, str(effects), "resume"], check=True
    )
    assert restarted.stdout.decode().splitlines() == ["sent first", "sent second"]
    keys = [json.loads(line)["key"] for line in effects.read_text().splitlines()]
    assert keys == ["run-crash/1:send", "run-crash/2:send"]  # each effect exactly once

    async with stopline.open(url) as ledger:
        receipt = await ledger.receipt("run-crash")
        events = await ledger.backend.events("run-crash")
    assert [line.status for line in receipt.lines] == [stopline.OpStatus.COMMITTED] * 2
    assert [e.kind for e in events].count("gate_passed") == 2  # the replay passed no gate again
