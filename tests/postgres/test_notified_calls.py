"""ADR 0041: a cancel's notification that names only runs with a call awaiting its tool
in this process is delivered without reading whether they are still fenced; any other
run it names is read first, as before, and all are delivered together.

On the real PostgreSQL. The victim is a whole runtime (``stopline.open``) listening; the
canceller is a bare backend of the same schema with no listener of its own (another
process's cancel). The listener's read is counted by wrapping ``reads.fenced_among``,
which still runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

import stopline
from stopline.domain.model import OperationRecord
from stopline.domain.vocab import OpStatus, Policy
from stopline.ledger.backend import Backend, OutcomeUpdate
from stopline.ledger.engine import reads
from stopline.ledger.engine.db import Db
from stopline.ledger.forwarding import ForwardingBackend
from stopline.ledger.postgres import PostgresBackend
from tests.postgres.test_backend import resumed_and_left
from tests.support.held import Held

pytestmark = pytest.mark.timeout(30)


class Checks:
    """Every read of which notified runs are still fenced, by the ids it asked about."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.asked: list[list[str]] = []
        real = reads.fenced_among

        async def counted(db: Db, run_ids: Sequence[str]) -> list[str]:
            self.asked.append(list(run_ids))
            return await real(db, run_ids)

        monkeypatch.setattr(reads, "fenced_among", counted)


async def test_a_cancel_of_a_run_awaiting_its_tool_here_is_delivered_unread(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call waits in its tool, so its operation is unresolved and the run cannot
    have been resumed since the cancel: the notification interrupts it without a read,
    and the call is recorded as the cancel's."""
    checks = Checks(monkeypatch)
    canceller = await PostgresBackend.open(pg_url)
    try:
        async with stopline.open(pg_url) as ledger, anyio.create_task_group() as tg:
            held = Held(ledger, "victim")
            tg.start_soon(held.workflow)
            await held.entered.wait()
            await canceller.cancel("victim", by="u")
            with anyio.fail_after(10):
                await held.interrupted.wait()
            receipt = await ledger.wait_settled("victim", timeout=10)
        assert checks.asked == []
        assert receipt.settled
        (line,) = receipt.lines
        # interrupted, recorded by the cancel, with no read-back: for a person to decide
        assert line.status is OpStatus.NEEDS_REVIEW
        assert "user_cancel" in [e.ref for e in line.evidence]
    finally:
        await canceller.close()


async def test_a_cancel_of_a_run_with_no_call_awaiting_here_is_read_first(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run open here between calls could have been resumed since the cancel: its
    notification is delivered only after a read finds it still fenced."""
    checks = Checks(monkeypatch)
    canceller = await PostgresBackend.open(pg_url)
    try:
        async with stopline.open(pg_url) as ledger:
            heard = anyio.Event()
            ledger.on_cancel(lambda run_ids: heard.set())
            # at_boundary: the delivery interrupts nothing, so the block sees it arrive
            async with ledger.run(
                "idle", owner="u", run_id="idle", policy=Policy.AT_BOUNDARY
            ) as run:
                assert not run.awaits_a_tool()
                await canceller.cancel("idle", by="u")
                with anyio.fail_after(10):
                    await heard.wait()
                assert run.cancel_requested  # delivered, after the read
                assert checks.asked == [["idle"]]
        assert checks.asked == [["idle"]]
    finally:
        await canceller.close()


async def test_a_notification_reads_only_the_runs_not_held_and_delivers_all_together(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A held run is not read; of the rest only those still fenced are delivered (one
    resumed since its cancel is not), in the notification's order, in one delivery."""
    seen: list[list[str]] = []
    async with stopline.open(pg_url) as ledger:
        backend = await resumed_and_left(ledger)
        checks = Checks(monkeypatch)
        payload = '["held", "resumed", "left"]'
        await backend.listener.deliver(payload, seen.append, holding={"held"}.__contains__)
        assert checks.asked == [["resumed", "left"]]
        await backend.listener.deliver('["held"]', seen.append, holding={"held"}.__contains__)
        assert checks.asked == [["resumed", "left"]]  # nothing to read
    assert seen == [["held", "left"], ["held"]]


class Recording(ForwardingBackend):
    """Holds each strict outcome's write until ``go`` (``writing`` set meanwhile)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.writing = anyio.Event()
        self.go = anyio.Event()

    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        self.writing.set()
        await self.go.wait()
        return await self.inner.record(op_id, update)


async def test_a_call_whose_tool_answered_is_not_held_while_its_outcome_is_written(
    pg_url: str,
) -> None:
    """Once the tool has answered, this process may resolve the operation (here the
    strict mode writes the outcome before the call returns), and a resume may follow:
    the call is still in flight, but no longer lets a notification skip its read."""
    observers: list[Recording] = []

    def observe(backend: Backend) -> Backend:
        observers.append(Recording(backend))
        return observers[-1]

    @stopline.tool
    async def step(ctx: stopline.CallContext) -> int:
        return 1

    async with stopline.open(pg_url, observers=[observe], durable_outcomes=True) as ledger:
        (recording,) = observers
        async with anyio.create_task_group() as tg, ledger.run("job", owner="u") as run:
            tg.start_soon(run.call, step)
            try:
                with anyio.fail_after(10):
                    await recording.writing.wait()
                assert run.in_flight  # the call has not returned: its outcome is being written
                assert not run.awaits_a_tool()
            finally:
                recording.go.set()
