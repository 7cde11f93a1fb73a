"""asyncio's own ``Task.cancel()`` (what Ctrl-C does under ``asyncio.run``, what a
framework does to its task) of a task that runs stopline runs, on a real SQLite ledger.

The writer lets a cancelled caller learn the outcome of a job that finishes within
its grace; a cancel scope's cancel comes again by itself, asyncio's is delivered once.
It was held back and lost: a loop of 5,000 runs, cancelled at its 50th, ran them all.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import stopline

pytestmark = pytest.mark.timeout(60)

RUNS = 5_000


@pytest.mark.parametrize("with_call", [True, False], ids=["runs-with-a-call", "empty-runs"])
def test_a_native_cancel_of_a_task_running_runs_ends_it_at_once(
    tmp_path: Path, with_call: bool
) -> None:
    async def send(ctx: stopline.CallContext) -> str:
        return ctx.key

    tool = stopline.Tool(send)
    done: list[int] = []

    async def worker(fiftieth: asyncio.Event) -> None:
        async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
            for n in range(RUNS):
                async with ledger.run("job", owner="user:1") as run:
                    if with_call:
                        await run.call(tool)
                done.append(n)
                if n == 50:
                    fiftieth.set()

    async def main() -> None:
        fiftieth = asyncio.Event()
        task = asyncio.create_task(worker(fiftieth))
        await fiftieth.wait()
        at = len(done)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # ended within the run it was in, or the next: never the remaining thousands
        assert len(done) <= at + 2 < RUNS

    asyncio.run(main())
