"""A call cut by asyncio's own ``Task.cancel``, cancelled again while its ``unknown`` was
being written, is still read back or sent to review (ADR 0071).

A framework that runs tools in asyncio tasks of its own (LangGraph's runner, a
``gather``) cancels them with ``Task.cancel()``, and again while they unwind. anyio's
shield around the outcome's write holds a scope's cancel, not that one: it cut the
wait after the write had landed, and what follows a recorded outcome (its read-back
queued) never ran. The run ended ``completed`` beside an ``unknown`` whose receipt said
"verifying" for ever, and ``wait_settled`` timed out. The second cancel is delivered
here by a backend observer, once the ``unknown`` is written (a barrier: no timing).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import pytest

import stopline
from stopline import OpStatus, RunState, Verdict
from stopline.domain.model import OperationRecord
from stopline.domain.vocab import OpEvent
from stopline.ledger.backend import Backend, OutcomeUpdate
from stopline.ledger.forwarding import ForwardingBackend
from tests.conftest import FAST_VERIFY

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.parametrize("ledger_backend", ["sqlite", "postgres"], indirect=True),
]


class CancelledAgainWhileWriting(ForwardingBackend):
    """Once the lost answer of an operation is written, ``Task.cancel()`` the task that
    runs its call, as a framework cancelling its tasks again does, before the write's
    caller is woken."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.target: asyncio.Task[str] | None = None
        self.cancelled_again = False

    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        op = await super().record(op_id, update)
        if update.event is OpEvent.LOST and self.target is not None:
            self.target.cancel()
            self.cancelled_again = True
            await anyio.lowlevel.checkpoint()  # where the cancel lands if it is this task
        return op


@contextlib.asynccontextmanager
async def observed(url: str) -> AsyncIterator[tuple[stopline.Ledger, CancelledAgainWhileWriting]]:
    wraps: list[CancelledAgainWhileWriting] = []

    def wrap(backend: Backend) -> Backend:
        wraps.append(CancelledAgainWhileWriting(backend))
        return wraps[-1]

    ledger = stopline.open(url, verify=FAST_VERIFY, observers=[wrap])
    # no renewal within the test: its sweep queues every ``unknown`` again, which hid
    # the lost read-back for a third of the lease
    ledger.lease = 3600.0
    async with ledger:
        yield ledger, wraps[0]


@pytest.mark.parametrize(
    ("read_back", "settled"),
    [(False, OpStatus.NEEDS_REVIEW), (True, OpStatus.NOT_COMMITTED)],
    ids=["no-read-back-review", "read-back"],
)
async def test_an_unknown_is_read_back_or_sent_to_review(
    ledger_url: str, read_back: bool, settled: OpStatus
) -> None:
    """With a verifier the ``unknown`` is read back (nothing was sent: not committed);
    with none it is sent to review; either way the receipt settles."""
    reached = anyio.Event()
    sent: list[str] = []

    @stopline.tool
    async def send(ctx: stopline.CallContext) -> str:
        reached.set()
        await anyio.sleep_forever()
        sent.append(ctx.key)
        return "sent"

    async def verify(ctx: stopline.CallContext) -> stopline.ReadBack:
        found = Verdict.COMMITTED if ctx.key in sent else Verdict.NOT_COMMITTED
        return stopline.ReadBack(found, "outbox", "read back")

    if read_back:
        send.verifier(verify)
    async with observed(ledger_url) as (ledger, hooks):
        run_id = await _cut(ledger, hooks, send, reached)
        receipt = await ledger.wait_settled(run_id, timeout=10)
    assert [line.status for line in receipt.lines] == [settled]
    assert "verifying" not in receipt.text()
    assert sent == []


async def _cut(
    ledger: stopline.Ledger,
    hooks: CancelledAgainWhileWriting,
    tool: stopline.Tool[str],
    reached: anyio.Event,
) -> str:
    """A run whose one call runs in an asyncio task of its own, cut by ``Task.cancel()``
    once the tool is at work and cancelled again as its ``unknown`` is written; the
    block then ends (completed: the run itself was not cancelled). Its id."""
    async with ledger.run("agent", owner="user:1", run_id="native-cut") as run:
        task = asyncio.ensure_future(run.call(tool, key="k"))
        hooks.target = task
        await reached.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert hooks.cancelled_again
    assert (await ledger.backend.get_run(run.id)).state is RunState.COMPLETED
    return run.id
