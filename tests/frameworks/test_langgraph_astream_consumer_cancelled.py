"""LangGraph: the task iterating ``graph.astream`` in ``sl.run``'s block, cancelled while a
gated tool call is at work (ADR 0071).

LangGraph's runner cancels the tasks it runs tools in with asyncio's own
``Task.cancel()``, and again while they unwind. The second one cut the wait for the
call's ``unknown`` once it was written, and its read-back was never queued: the run
ended ``completed`` beside an operation whose receipt said "verifying" with nobody
verifying, and ``ledger.wait_settled`` timed out. Now it is read back when it can be,
else sent to review, on both backends. Real graphs (``test_langgraph_gate.Graph``,
``GenericFakeChatModel``), a real file as the effect, barriers.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from stopline import OpStatus, RunState
from stopline.integrations import langgraph as sl
from tests.conftest import FAST_VERIFY
from tests.frameworks.effects import FileEffect
from tests.frameworks.test_langgraph_gate import Graph, start, write_tool

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.parametrize("ledger_backend", ["sqlite", "postgres"], indirect=True),
]


@contextlib.asynccontextmanager
async def opened(url: str) -> AsyncIterator[stopline.Ledger]:
    ledger = stopline.open(url, verify=FAST_VERIFY)
    # no lease renewal within the test: its sweep queues every ``unknown`` again, which
    # hid the lost read-back for a third of the lease
    ledger.lease = 3600.0
    async with ledger:
        yield ledger


async def consumer_cancelled_mid_call(
    ledger: stopline.Ledger, graph: Graph, effect: FileEffect, thread: str
) -> None:
    """``graph.astream`` iterated by a task of the run's block, cancelled once the tool is
    at work; then the block ends (the stopline run itself was not cancelled)."""
    async with sl.run(ledger, owner="user:1", thread_id=thread) as g:
        compiled: Any = graph.graph  # its input: the chat's messages

        async def consume() -> None:
            async for _ in compiled.astream(start(), g.config):
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await effect.async_reached.wait()
            tg.cancel_scope.cancel()
    assert (await ledger.backend.get_run(thread)).state is RunState.COMPLETED


@pytest.mark.parametrize(
    ("read_back", "settled"),
    [(False, OpStatus.NEEDS_REVIEW), (True, OpStatus.NOT_COMMITTED)],
    ids=["no-read-back-review", "read-back"],
)
async def test_an_interrupted_call_is_read_back_or_sent_to_review(
    ledger_url: str, tmp_path: Path, read_back: bool, settled: OpStatus
) -> None:
    """With a verifier the call is read back (nothing written: not committed); with
    none it goes to review; either way the receipt settles, "verifying" gone."""
    thread = f"lg-astream-{read_back}"
    async with opened(ledger_url) as ledger:
        with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
            verify = effect.read_back() if read_back else None
            graph = Graph(write_tool(effect, sync=False), verify=verify)
            await consumer_cancelled_mid_call(ledger, graph, effect, thread)
            receipt = await ledger.wait_settled(thread, timeout=10)
    assert [line.status for line in receipt.lines] == [settled]
    assert "verifying" not in receipt.text()
    assert effect.lines() == []
