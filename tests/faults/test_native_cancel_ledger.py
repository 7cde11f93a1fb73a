"""asyncio's own ``Task.cancel`` reaching a ledger write: the write goes to its end, every
caller of it learns its outcome, and the cancel still reaches the task it was meant for.

A framework that runs tools in asyncio tasks of its own (LangGraph's runner, a
``gather``, ``asyncio.timeout``) cancels them with ``Task.cancel()``, which no anyio
shield holds. On a real PostgreSQL and a real SQLite file:

- the task leading a PostgreSQL group transaction, cancelled mid-transaction, left
  every other caller of its group (another run's gate) waiting for ever;
- a PostgreSQL caller cancelled while its write waited in the queue learnt its outcome
  and went on as if never cancelled (the cancel was taken and dropped);
- an outcome whose write the cancel first reached (SQLite: the write's wait; PostgreSQL:
  psycopg's, which also asks the server to cancel the statement) landed, but what
  follows it never ran: an ``unknown`` nobody read back or sent to review.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import stopline
from stopline import OpStatus, Verdict
from stopline.domain.model import OperationRecord
from stopline.domain.vocab import OpEvent
from stopline.ledger.backend import Backend, GateVerdict, OutcomeUpdate
from stopline.ledger.forwarding import ForwardingBackend
from stopline.ledger.postgres import PostgresBackend
from tests.conftest import FAST_VERIFY
from tests.ledger.contract import COMMIT, op_spec, run_spec

pytestmark = pytest.mark.timeout(60)

GUARD = 20  # against a hang, not a timing


@pytest.fixture
async def backend(pg_url: str) -> AsyncIterator[PostgresBackend]:
    # no timer: only a write commits the deferred outcome (it makes the next gate a group)
    opened = await PostgresBackend.open(pg_url + "&group_commit_ms=60000&retry_for=5")
    try:
        yield opened
    finally:
        with anyio.fail_after(GUARD):
            await opened.close()


async def test_the_leader_of_a_group_cancelled_mid_transaction_holds_no_caller_up(
    backend: PostgresBackend,
) -> None:
    """Gate 1 leads a group transaction and holds it; gates 2 (run b) and 3 (run c)
    queue behind it; the caller handed the next transaction is cancelled as it is sent.
    Every gate passes once, and the cancelled caller learns its verdict, then its
    cancel reaches it."""
    for run in ("run_a", "run_b", "run_c"):
        await backend.create_run(run_spec(run))
    await backend.gate(op_spec("run_a/0:send"))
    backend.record_deferred("run_a/0:send", COMMIT, lambda outcome: None)  # gate 1 groups
    held, go = anyio.Event(), anyio.Event()
    tasks: dict[str, asyncio.Task[None]] = {}
    verdicts: dict[str, GateVerdict] = {}

    async def hold_then_cancel_the_leader(pid: int) -> None:
        if not held.is_set():  # the first group: held until both others queue
            held.set()
            await go.wait()
            return
        tasks["run_b/1:send"].cancel()  # the next leader: its own caller's task
        await anyio.lowlevel.checkpoint()

    backend.group.before_batch = hold_then_cancel_the_leader

    async def gate(op_id: str) -> None:
        verdicts[op_id] = (await backend.gate(op_spec(op_id, op_id.split("/")[0]))).verdict

    for op_id in ("run_a/1:send", "run_b/1:send", "run_c/1:send"):
        tasks[op_id] = asyncio.ensure_future(gate(op_id))
        if op_id == "run_a/1:send":
            await held.wait()
    while len(backend.group._queue) < 2:  # both queued behind the held transaction
        await anyio.lowlevel.checkpoint()
    go.set()
    with anyio.fail_after(GUARD):
        await asyncio.wait(tasks.values())
    assert verdicts == dict.fromkeys(tasks, GateVerdict.PASSED)
    assert tasks["run_b/1:send"].cancelled()  # its cancel reached it, once it knew
    assert not tasks["run_c/1:send"].cancelled()
    for run in ("run_a", "run_b", "run_c"):
        passed = [e.op_id for e in await backend.events(run) if e.kind == "gate_passed"]
        assert passed.count(f"{run}/1:send") == 1


async def test_a_caller_cancelled_while_queued_learns_its_verdict_and_is_cancelled(
    backend: PostgresBackend,
) -> None:
    """As a scope's cancel does (``test_group_commit``), asyncio's own: the queued gate
    is written once, its caller learns it passed, and the cancel then reaches it (it
    was taken while the write finished, and dropped: the caller went on)."""
    await backend.create_run(run_spec())
    await backend.gate(op_spec("run_a/0:send"))
    backend.record_deferred("run_a/0:send", COMMIT, lambda outcome: None)
    held, go = anyio.Event(), anyio.Event()

    async def hold(pid: int) -> None:
        held.set()
        await go.wait()

    backend.group.before_batch = hold
    got: dict[str, Any] = {}

    async def queued() -> None:
        got["gate"] = await backend.gate(op_spec("run_a/2:send"))
        await anyio.lowlevel.checkpoint()
        got["went on"] = True

    leader = asyncio.ensure_future(backend.gate(op_spec("run_a/1:send")))
    await held.wait()
    backend.group.before_batch = None
    task = asyncio.ensure_future(queued())
    while not any(job.op_id == "run_a/2:send" for job in backend.group._queue):
        await anyio.lowlevel.checkpoint()
    task.cancel()
    await anyio.lowlevel.checkpoint()
    go.set()
    with anyio.fail_after(GUARD):
        await asyncio.wait([leader, task])
    assert got["gate"].verdict is GateVerdict.PASSED and "went on" not in got
    assert task.cancelled()
    passed = [e.op_id for e in await backend.events("run_a") if e.kind == "gate_passed"]
    assert passed == ["run_a/0:send", "run_a/1:send", "run_a/2:send"]


class CancelledAsTheWriteStarts(ForwardingBackend):
    """``Task.cancel()`` the task that runs the call as its lost answer's write starts: the
    cancel reaches the ledger's own wait for that write (a framework's cancel that
    arrives as the outcome is being recorded)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.target: asyncio.Task[str] | None = None

    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        if update.event is OpEvent.LOST and self.target is not None:
            self.target.cancel()
        return await super().record(op_id, update)


@pytest.mark.parametrize("ledger_backend", ["sqlite", "postgres"], indirect=True)
@pytest.mark.parametrize(
    ("read_back", "settled"),
    [(False, OpStatus.NEEDS_REVIEW), (True, OpStatus.NOT_COMMITTED)],
    ids=["no-read-back-review", "read-back"],
)
async def test_an_unknown_whose_write_a_cancel_reaches_is_read_back_or_sent_to_review(
    ledger_url: str, read_back: bool, settled: OpStatus
) -> None:
    @stopline.tool
    async def send(ctx: stopline.CallContext) -> str:
        raise stopline.NoAnswer(stopline.Cause.TRANSPORT, "the reply was lost")

    async def verify(ctx: stopline.CallContext) -> stopline.ReadBack:
        return stopline.ReadBack(Verdict.NOT_COMMITTED, "outbox", "nothing there")

    if read_back:
        send.verifier(verify)
    wraps: list[CancelledAsTheWriteStarts] = []

    def wrap(backend: Backend) -> Backend:
        wraps.append(CancelledAsTheWriteStarts(backend))
        return wraps[-1]

    ledger = stopline.open(ledger_url, verify=FAST_VERIFY, observers=[wrap])
    ledger.lease = 3600.0  # no renewal sweep: it queues every ``unknown`` again
    async with ledger:
        async with ledger.run("agent", owner="user:1", run_id="native-write") as run:
            task = asyncio.ensure_future(run.call(send, key="k"))
            wraps[0].target = task
            with contextlib.suppress(asyncio.CancelledError, stopline.NoAnswer):
                await task
        receipt = await ledger.wait_settled(run.id, timeout=10)
    assert [line.status for line in receipt.lines] == [settled]
    assert "verifying" not in receipt.text()
