"""Many ``wait_settled`` calls in one process: a receipt is read again only when the
ledger may have changed (its change mark moved, or this process changed the run),
not every poll of every waiter.

Counted, not timed, through a backend observer, on SQLite and PostgreSQL. Another
``stopline.open`` of the same ledger stands for another process.
"""

from __future__ import annotations

import contextlib

import anyio
import pytest

import stopline
from stopline import RunState
from stopline.domain.model import OperationRecord, RunRecord
from stopline.errors import LedgerIOError, UnknownRun
from stopline.ledger.backend import Backend
from stopline.ledger.forwarding import ForwardingBackend
from tests.support.observed import open_observed

WAITERS = 20


class ReceiptReads(ForwardingBackend):
    """Counts the receipts read (``run_and_operations``) and the change marks read,
    with the marks' values, since ``reset``; ``marks`` is set once ``marks_wanted``
    marks have been read."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.receipts = 0
        self.marks_read = 0
        self.marks_wanted = 0
        self.marks = anyio.Event()
        self.values: set[str] = set()

    def reset(self, marks_wanted: int) -> None:
        self.receipts = self.marks_read = 0
        self.marks_wanted, self.marks = marks_wanted, anyio.Event()
        self.values = set()

    async def run_and_operations(
        self, run_id: str, *, descendants: bool = False
    ) -> tuple[RunRecord, list[OperationRecord]]:
        self.receipts += 1
        return await self.inner.run_and_operations(run_id, descendants=descendants)

    async def change_mark(self) -> str:
        mark = await self.inner.change_mark()
        self.values.add(mark)
        self.marks_read += 1
        if self.marks_read >= self.marks_wanted:
            self.marks.set()
        return mark


@stopline.tool
async def step(ctx: stopline.CallContext) -> str:
    return "done"


async def paused_runs(ledger: stopline.Ledger) -> list[str]:
    """``WAITERS`` runs with a call each, paused and left: not settled, and nothing
    in them moves until someone resumes or cancels them."""
    ids = []
    for n in range(WAITERS):
        async with ledger.run(f"r{n}", owner="u") as run:
            await run.call(step)
            await run.suspend("waiting for a person")  # paused; its block ends, the run stays
            ids.append(run.id)
    return ids


async def test_waiters_on_a_quiet_ledger_read_their_receipts_once(ledger_url: str) -> None:
    """While nothing is committed, the change mark holds still, each waiter reads its
    receipt once, and the process reads the mark a few times for all of them (the code
    that read every receipt each poll reads about three times as often). Another
    process's cancels then move the mark, and every waiter sees its run settle.

    Both engines' marks move with this ledger's commits alone: on PostgreSQL, another
    database's commits or autovacuum moved the mark before (the server's WAL position),
    and a CI run failed here with 40 reads for 20."""
    async with open_observed(ledger_url, ReceiptReads) as (ledger, reads):
        ids = await paused_runs(ledger)
        settled: dict[str, stopline.Receipt] = {}

        async def wait(run_id: str) -> None:
            settled[run_id] = await ledger.wait_settled(run_id, timeout=60)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                reads.reset(marks_wanted=8)  # about three polls of 0.25 s (one per 0.1 s)
                for run_id in ids:
                    tg.start_soon(wait, run_id)
                await reads.marks.wait()
                assert len(reads.values) == 1  # nothing committed, nothing moved
                assert reads.receipts == WAITERS  # each waiter's first read, no more
                assert reads.marks_read < WAITERS  # shared: not one per waiter a poll
                async with stopline.open(ledger_url) as other:
                    for run_id in ids:
                        await other.cancel(run_id, by="u")
    assert sorted(settled) == sorted(ids)
    assert all(r.run_state is RunState.CANCELLED and r.settled for r in settled.values())


async def test_a_change_made_here_is_read_at_once(ledger_url: str) -> None:
    """A cancel made in this process wakes its waiter, which reads the receipt again
    whatever the mark says."""
    async with open_observed(ledger_url, ReceiptReads) as (ledger, reads):
        (run_id, *_) = await paused_runs(ledger)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ledger.wait_settled, run_id)
                reads.reset(marks_wanted=1)
                await reads.marks.wait()
                await ledger.cancel(run_id, by="u")
        receipt = await ledger.receipt(run_id)
    assert receipt.settled and receipt.run_state is RunState.CANCELLED


async def test_waiting_on_a_run_that_does_not_exist_says_so(ledger_url: str) -> None:
    async with stopline.open(ledger_url) as ledger:
        with anyio.fail_after(10), contextlib.suppress(UnknownRun):
            await ledger.wait_settled("run_nowhere", timeout=5)
            raise AssertionError("wait_settled returned for a run that does not exist")


class MarkFails(ReceiptReads):
    """The change mark's read fails (the ledger's I/O), after the first receipt."""

    async def change_mark(self) -> str:
        if self.receipts:
            raise LedgerIOError("ledger", "the change mark's read failed (injected)")
        return await super().change_mark()


async def test_a_failing_mark_read_reaches_the_waiter_as_a_typed_error(ledger_url: str) -> None:
    """The mark's read failing is the waiter's error, typed, as a receipt's read
    failing is; nothing hangs, and the run is as it was."""
    async with open_observed(ledger_url, MarkFails) as (ledger, _):
        (run_id, *_) = await paused_runs(ledger)
        with anyio.fail_after(30), pytest.raises(LedgerIOError):
            await ledger.wait_settled(run_id)
        assert (await ledger.backend.get_run(run_id)).state is RunState.PAUSED
