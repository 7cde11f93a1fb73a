"""Calls waiting at the gate of a paused run (R9): one read of the paused runs a poll
for the whole process, not one gate transaction a poll for each waiting call.

Counted, not timed: the gate's transactions and the watch's reads, through a backend
observer. On SQLite and PostgreSQL; another ``stopline.open`` of the same ledger
stands for another process (its own runtime, its own connections): what it resumes
or cancels reaches the waiting calls only through the watch's read.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import pytest

import stopline
from stopline import OpStatus, RunState
from stopline.domain.model import OperationSpec, RunRecord
from stopline.errors import LedgerIOError
from stopline.ledger.backend import Backend, GateResult
from stopline.ledger.forwarding import ForwardingBackend
from tests.support.observed import open_observed

WAITING = 30


class GateCounter(ForwardingBackend):
    """Counts the gate's transactions and the paused runs' reads: ``enough_reads`` is
    set once the watch has read all ``WAITING`` runs at once ``reads_wanted`` times;
    with ``fail_reads`` each read fails, and ``failed`` is set at the first."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.gates = 0
        self.full_reads = 0
        self.reads_wanted = 3
        self.enough_reads = anyio.Event()
        self.fail_reads = False
        self.failed = anyio.Event()

    async def gate(self, spec: OperationSpec) -> GateResult:
        self.gates += 1
        return await self.inner.gate(spec)

    async def get_runs(self, run_ids: Sequence[str]) -> dict[str, RunRecord]:
        self.full_reads += len(run_ids) == WAITING
        if self.full_reads >= self.reads_wanted:
            self.enough_reads.set()
        if self.fail_reads:
            self.failed.set()
            raise LedgerIOError("ledger", "the paused runs' read failed (injected)")
        return await self.inner.get_runs(run_ids)


@stopline.tool
async def step(ctx: stopline.CallContext, n: int) -> int:
    return n


async def paused_calls(
    ledger: stopline.Ledger, tg: anyio.abc.TaskGroup, done: list[str]
) -> list[str]:
    """``WAITING`` runs, each paused with a call waiting at its gate; their ids. A
    run's id goes to ``done`` once its call has gone through."""
    ids: list[str] = []
    opened, go = anyio.Event(), anyio.Event()

    async def workflow(n: int) -> None:
        async with ledger.run(f"paused-{n}", owner="u") as run:
            ids.append(run.id)
            if len(ids) == WAITING:
                opened.set()
            await go.wait()
            assert await run.call(step, n) == n
            done.append(run.id)

    for n in range(WAITING):
        tg.start_soon(workflow, n)
    await opened.wait()
    for run_id in ids:
        await ledger.pause(run_id, by="u")
    go.set()
    return ids


@contextlib.asynccontextmanager
async def counted(url: str) -> AsyncIterator[tuple[stopline.Ledger, GateCounter]]:
    """A ledger whose gate transactions and paused-run reads are counted, reading its
    paused runs every 10 ms; a waiting call asks the gate on its own only after 60 s
    (the counts are exact unless a test lowers it)."""
    async with open_observed(url, GateCounter) as (ledger, counter):
        ledger.core.paused_poll = 0.01
        ledger.core.paused_fallback = 60
        yield ledger, counter


async def test_waiting_calls_ask_the_gate_once_until_their_run_moves(ledger_url: str) -> None:
    """Three polls pass with every call waiting: each asked the gate once (the call
    before took a gate transaction each a poll); the watch read all of them in one
    read a poll. A resume here wakes them at once; each asks the gate once more."""
    done: list[str] = []
    async with counted(ledger_url) as (ledger, counter):
        with anyio.fail_after(60):  # a stranded call fails the test, it does not hang it
            async with anyio.create_task_group() as tg:
                ids = await paused_calls(ledger, tg, done)
                await counter.enough_reads.wait()
                assert counter.gates == WAITING  # each call's first try, no more
                assert done == []
                for run_id in ids:
                    await ledger.resume(run_id, by="u")
        assert sorted(done) == sorted(ids)
        assert counter.gates == 2 * WAITING  # and one more once resumed
        assert ledger.core.waiting_runs == 0  # nothing per run left behind


async def test_a_resume_from_another_process_reaches_the_waiting_calls(ledger_url: str) -> None:
    """Another process's resume is seen by the watch's read (nothing here changed the
    runs); its cancel likewise ends the waiting calls at the fence."""
    done: list[str] = []
    async with counted(ledger_url) as (ledger, counter):
        resumed: list[str] = []
        with anyio.fail_after(60):  # a stranded call fails the test, it does not hang it
            async with anyio.create_task_group() as tg:
                ids = await paused_calls(ledger, tg, done)
                await counter.enough_reads.wait()
                resumed = ids[: WAITING // 2]
                async with stopline.open(ledger_url) as other:
                    for run_id in resumed:
                        await other.resume(run_id, by="u")
                    for run_id in ids[WAITING // 2 :]:
                        await other.cancel(run_id, by="u")
            # the task group ended: every waiting call left, none was stranded
        assert sorted(done) == sorted(resumed)  # resumed: each call went through
        for run_id in ids[WAITING // 2 :]:  # cancelled: the call met the fence, unsent
            receipt = await ledger.wait_settled(run_id, timeout=30)
            assert receipt.run_state is RunState.CANCELLED
            # its call never left: refused at the fence (recorded so, or not at all
            # when the run had settled before the call asked the gate again)
            assert all(line.status is OpStatus.PREVENTED for line in receipt.lines)


async def test_a_failing_read_of_the_paused_runs_strands_no_call(ledger_url: str) -> None:
    """The watch's read failing (the ledger's I/O) is reported and retried, and the
    calls fall back to asking the gate themselves, less often: a resume from
    elsewhere still lands."""
    done: list[str] = []
    async with counted(ledger_url) as (ledger, counter):
        counter.fail_reads = True
        ledger.core.paused_fallback = 0.05  # each call asks the gate on its own, soon
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                ids = await paused_calls(ledger, tg, done)
                await counter.failed.wait()  # the watch has met the fault
                async with stopline.open(ledger_url) as other:
                    for run_id in ids:
                        await other.resume(run_id, by="u")
        assert sorted(done) == sorted(ids)
        assert ledger.core.health.steps["watch_paused"].failures >= 1  # reported, retried


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_on_trio_the_waiting_calls_are_woken_by_a_resume(tmp_path: Path) -> None:
    done: list[str] = []
    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}") as ledger:
        ledger.core.paused_poll = 0.01
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                ids = await paused_calls(ledger, tg, done)
                for run_id in ids:
                    await ledger.resume(run_id, by="u")
    assert sorted(done) == sorted(ids)
