"""R9/R10 probe across processes: a worker's call is in flight when another process
pauses its run, and the worker is SIGKILLed while the run is pausing. The receipt
says the action may have happened; the resume, followed literally (re-enter the run
with its id), reads the destination back first and sends nothing twice.
"""

from __future__ import annotations

import json
import signal
import sys
import textwrap
from pathlib import Path

import anyio

import stopline
from stopline import OpStatus, RunState

WORKER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import anyio, stopline

    url, effects, stage = sys.argv[1], Path(sys.argv[2]), sys.argv[3]

    def done() -> list[str]:
        lines = effects.read_text().splitlines() if effects.exists() else []
        return [json.loads(line)["key"] for line in lines]

    @stopline.tool
    async def send(ctx: stopline.CallContext, what: str) -> str:
        if ctx.key not in done():  # the provider's own record, idempotent by key
            with effects.open("a") as f:
                f.write(json.dumps({"key": ctx.key}) + "\\n")
        if stage == "hold":
            print("in flight", flush=True)
            await anyio.sleep_forever()  # the answer never comes back: SIGKILL lands here
        return f"sent {what}"

    @send.verifier
    async def _(ctx: stopline.CallContext) -> stopline.Verdict:
        return stopline.Verdict.COMMITTED if ctx.key in done() else stopline.Verdict.NOT_COMMITTED

    async def main() -> None:
        async with stopline.open(url, tools=[send], durable_outcomes=True) as ledger:
            async with ledger.run("mail", owner="user:1", run_id="w1") as run:
                print(await run.call(send, "first"), flush=True)
                print(await run.call(send, "second"), flush=True)

    anyio.run(main)
""")


async def test_a_worker_killed_while_its_run_pauses_repeats_nothing_on_resume(
    tmp_path: Path, ledger_url: str
) -> None:
    script, effects = tmp_path / "worker.py", tmp_path / "effects.jsonl"
    await anyio.Path(script).write_text(WORKER)
    worker_args = [sys.executable, str(script), ledger_url, str(effects)]
    with anyio.fail_after(120):  # a hang guard
        async with await anyio.open_process([*worker_args, "hold"]) as worker:
            assert worker.stdout is not None
            seen = b""
            while b"in flight" not in seen:
                seen += await worker.stdout.receive()
            async with stopline.open(ledger_url) as other:  # another process pauses it
                paused = await other.pause("w1", by="user:1")
            worker.send_signal(signal.SIGKILL)
            await worker.wait()
        assert paused.run_state is RunState.PAUSING  # the call in flight holds the pause
        async with stopline.open(ledger_url) as ledger:
            receipt = await ledger.receipt("w1")
            assert receipt.lines[0].status in {OpStatus.REQUESTED, OpStatus.UNKNOWN}
            resumed = await ledger.resume("w1", by="user:1")
        assert resumed.run.state is RunState.RUNNING
        again = await anyio.run_process([*worker_args, "go"], check=True)
    assert again.stdout.decode().splitlines() == ["None", "sent second"]  # read back, not sent
    keys = [json.loads(line)["key"] for line in effects.read_text().splitlines()]
    assert keys == ["w1/1:send", "w1/2:send"]  # each effect exactly once
    async with stopline.open(ledger_url) as ledger:
        final = await ledger.receipt("w1")
    assert final.run_state is RunState.COMPLETED
    assert [line.status for line in final.lines] == [OpStatus.COMMITTED] * 2
