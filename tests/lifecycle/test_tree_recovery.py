"""A cancelled tree a dead worker left settles together on recovery (R6, S17).

A worker fenced a tree of many runs and died before settling them. The next
worker to open the ledger moves the stranded runs on. It stepped them one by
one, and each child that settled stepped its owner, which read its whole tree
again: a tree of 5,000 runs took 7 minutes on PostgreSQL (a second now). The
runs go in one request now; the test counts the owner's reads of its tree.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import stopline
from stopline import Headline, RunState
from stopline.ledger.engine.backend import SqlBackend
from tests.support.killed import run_until_then_kill

pytestmark = pytest.mark.timeout(120)

CHILDREN = 60
WORKER = textwrap.dedent("""
    import sys
    import anyio, stopline

    url, children = sys.argv[1], int(sys.argv[2])

    @stopline.tool
    async def send(ctx: stopline.CallContext, text: str) -> str:
        return text

    async def main() -> None:
        async with stopline.open(url, durable_outcomes=True) as ledger:
            ready = anyio.Event()
            done = 0

            async def child(run: stopline.Run, i: int) -> None:
                nonlocal done
                async with run.child(f"c{i}") as sub:
                    await sub.call(send, "x", key="k")
                    done += 1
                    if done == children:
                        ready.set()
                    await anyio.sleep_forever()

            async def parent() -> None:
                async with ledger.run("p", owner="user:1", run_id="root") as run:
                    async with anyio.create_task_group() as tg:
                        for i in range(children):
                            tg.start_soon(child, run, i)

            async with anyio.create_task_group() as tg:
                tg.start_soon(parent)
                await ready.wait()
                await ledger.cancel("root", by="user:1")
                print("fenced", flush=True)
                await anyio.sleep_forever()  # SIGKILL lands here

    anyio.run(main)
""")


async def _fence_and_die(tmp_path: Path, url: str) -> None:
    await run_until_then_kill(tmp_path / "worker.py", WORKER, b"fenced", url, str(CHILDREN))


async def test_a_stranded_cancelled_tree_settles_in_a_few_steps(
    tmp_path: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _fence_and_die(tmp_path, ledger_url)
    reads: list[list[str]] = []
    real = SqlBackend.unsettled_below

    async def counted(self: SqlBackend, run_ids: list[str]) -> object:
        reads.append(list(run_ids))
        return await real(self, run_ids)

    monkeypatch.setattr(SqlBackend, "unsettled_below", counted)
    async with stopline.open(ledger_url) as ledger:
        stranded = await ledger.backend.get_run("root")
        assert stranded.state is RunState.CANCELLING  # left by the dead worker
        receipt = await ledger.wait_settled("root", timeout=60)
    assert receipt.run_state is RunState.CANCELLED
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert len(receipt.lines) == CHILDREN
    # the owner read its tree when it could settle: a few times, not once per child
    owners = [ids for ids in reads if "root" in ids]
    assert 1 <= len(owners) <= 3, len(owners)
