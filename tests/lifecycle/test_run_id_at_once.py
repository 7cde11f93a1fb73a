"""Two entries of ``ledger.run(run_id=X)`` that both find no run X and make it at once.

The one whose write loses finds the winner's run and enters it, as it would have a
moment later; before, it got the database's raw duplicate-key error (``LedgerRefused``
on SQLite, ``LedgerError`` on PostgreSQL), a failure of nothing the caller did. Two
blocks of one process's ledger keep their rule: the second gets ``AlreadyAttached``.
A failure to make the run that leaves no run there is still raised as it came.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import pytest

import stopline
from stopline.domain.vocab import RunState
from tests.conftest import FAST_VERIFY
from tests.faults.recovery_outside_harness import outside_sql
from tests.support.held_reads import held_reads

pytestmark = pytest.mark.anyio


@pytest.fixture
async def other(ledger_url: str) -> AsyncIterator[stopline.Ledger]:
    """A second ledger on the same database: another worker process's."""
    async with stopline.open(ledger_url, verify=FAST_VERIFY) as opened:
        yield opened


def both_read_first() -> Callable[[], Awaitable[None]]:
    """A barrier for the first read of each of two entries (later reads pass)."""
    reads = [0]
    both = anyio.Event()

    async def after() -> None:
        reads[0] += 1
        if reads[0] >= 2:
            both.set()
        await both.wait()

    return after


async def test_two_workers_making_one_run_at_once_both_enter_it(
    ledger: stopline.Ledger, other: stopline.Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    after = both_read_first()
    held_reads(monkeypatch, ledger, after, "get_run")
    held_reads(monkeypatch, other, after, "get_run")
    entered: dict[str, str] = {}
    inside = anyio.Event()
    leave = anyio.Event()

    async def worker(name: str, worker_ledger: stopline.Ledger) -> None:
        async with worker_ledger.run("job", owner="user:1", run_id="at-once") as run:
            entered[name] = run.id
            if len(entered) == 2:
                inside.set()
            await leave.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker, "a", ledger)
        tg.start_soon(worker, "b", other)
        await inside.wait()
        monkeypatch.undo()
        assert (await ledger.backend.get_run("at-once")).state is RunState.RUNNING
        leave.set()
    assert entered == {"a": "at-once", "b": "at-once"}
    (record,) = [r for r in await ledger.backend.list_runs() if r.id == "at-once"]
    assert record.state is RunState.COMPLETED


async def test_two_blocks_of_one_ledger_at_once_the_second_is_already_attached(
    ledger: stopline.Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    held_reads(monkeypatch, ledger, both_read_first(), "get_run")
    outcomes: list[str | BaseException] = []
    leave = anyio.Event()

    async def block() -> None:
        try:
            async with ledger.run("job", owner="user:1", run_id="at-once") as run:
                outcomes.append(run.id)
                await leave.wait()
        except stopline.StoplineError as exc:
            outcomes.append(exc)
            leave.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(block)
        tg.start_soon(block)
    (entered,) = [o for o in outcomes if isinstance(o, str)]
    (refused,) = [o for o in outcomes if not isinstance(o, str)]
    assert entered == "at-once"
    assert isinstance(refused, stopline.AlreadyAttached), repr(refused)


async def test_a_run_that_cannot_be_made_is_still_the_ledgers_error(
    ledger: stopline.Ledger, ledger_url: str
) -> None:
    """A make the database refuses (an operator's trigger), with no run left there, is
    raised as it came; no run is entered or written."""
    trigger: tuple[str, ...]
    if ledger_url.startswith("sqlite:///"):
        trigger = (
            "CREATE TRIGGER refuse_run BEFORE INSERT ON runs WHEN NEW.id = 'never'"
            " BEGIN SELECT RAISE(ABORT, 'refused by a trigger'); END",
        )
    else:
        trigger = (
            "CREATE OR REPLACE FUNCTION refuse_run() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'refused by a trigger'; END $$",
            "CREATE TRIGGER refuse_run BEFORE INSERT ON runs FOR EACH ROW"
            " WHEN (NEW.id = 'never') EXECUTE FUNCTION refuse_run()",
        )
    outside_sql(ledger_url, *trigger)
    with pytest.raises(stopline.LedgerRefused, match="refused by a trigger"):
        async with ledger.run("job", owner="user:1", run_id="never"):
            pytest.fail("entered a run that was never made")
    with pytest.raises(stopline.NotFound):
        await ledger.backend.get_run("never")
    async with ledger.run("job", owner="user:1", run_id="made") as run:
        assert run.id == "made"
