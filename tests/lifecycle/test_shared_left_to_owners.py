"""R6: a shared run whose block another run's cancel cut, left ``running`` for its other
owners, says so in its log (ADR 0065, amendment 3).

Before, the block's end wrote nothing: the run's log ended on the cut run's
``owner_released`` and the run was still ``running``, with no block and no word of
why (a reader of ``stopline show`` saw a run that looked forgotten). Now the block's
end writes ``left_to_owners`` (which run's cancel cut it, the owners it goes on for) in
the transaction that reads its owners, with its row locked: the record and a fence of
it by its last owner's cancel never cross.
"""

from __future__ import annotations

import json
import os
import sys

import anyio
import pytest

import stopline
from stopline import RunState
from stopline.domain.vocab import LogKind, RunEvent
from stopline.ledger.backend import Backend
from stopline.ledger.postgres import PostgresBackend
from tests.faults.test_postgres_faults import commit_reply_lost_once
from tests.ledger.contract import run_spec
from tests.lifecycle.test_shared_child_r6_nested_block import _a_cancelled_around_s

pytestmark = pytest.mark.timeout(60)


async def _left(backend: Backend, run_id: str) -> list[dict[str, object]]:
    """The data of the run's ``left_to_owners`` events, without their attempt marks."""
    return [
        {k: v for k, v in e.data.items() if k != "attempt"}
        for e in await backend.events(run_id)
        if e.kind == LogKind.LEFT_TO_OWNERS
    ]


async def test_a_block_left_to_its_owners_says_why_in_its_log(
    ledger: stopline.Ledger, ledger_url: str
) -> None:
    """``A``'s cancel cuts shared ``S``'s block, ``B`` holds it: ``S``'s log says so, and
    ``stopline show S`` lists it in its timeline."""
    async with ledger.run("b", owner="u", run_id="B") as b:
        assert await _a_cancelled_around_s(ledger, b.id) == ["interrupted"]
        assert (await ledger.reads.run("S")).state is RunState.RUNNING
        assert await _left(ledger.backend, "S") == [{"cut_by": "A", "owners": ["B"]}]
        kinds = [e.kind for e in await ledger.backend.events("S")]  # after A let it go
        assert kinds.index(LogKind.LEFT_TO_OWNERS) > kinds.index(LogKind.OWNER_RELEASED)
        shown = await anyio.run_process(
            [sys.executable, "-m", "stopline.cli", "show", "S", "--json"],
            env={**os.environ, "STOPLINE_LEDGER": ledger_url},
            check=False,
        )
        assert shown.returncode == 0, shown.stderr
        entries = json.loads(shown.stdout)["timeline"]
        said = [(e["words"], e["detail"]) for e in entries if e["kind"] == LogKind.LEFT_TO_OWNERS]
        assert said == [("left to owners", "cut by: A; owners: B")]
        # the link B holds it by: which owner, and who made it (one event, ADR 0065)
        linked = [e["detail"] for e in entries if e["kind"] == LogKind.OWNER_ADDED]
        assert linked == ["owner: B; by: u"]
        await ledger.cancel(b.id, by="u")


async def test_a_run_its_owners_ended_without_is_ended_by_its_own_cancel(
    ledger: stopline.Ledger,
) -> None:
    """Decided: nothing ends a run left to its owners on its own (the ledger cannot tell
    whether an owner entered it again). ``B`` completes without going on with ``S``: it
    stays ``running``, its log says why, and its own cancel ends it (governed: ``S``'s
    owner's), its calls settled."""
    async with ledger.run("b", owner="u", run_id="B") as b:
        assert await _a_cancelled_around_s(ledger, b.id) == ["interrupted"]
    assert (await ledger.reads.run("B")).state is RunState.COMPLETED
    assert (await ledger.reads.run("S")).state is RunState.RUNNING
    assert await _left(ledger.backend, "S") == [{"cut_by": "A", "owners": ["B"]}]
    await ledger.cancel("S", by="u")
    settled = await ledger.wait_settled("S", timeout=30)
    assert settled.run_state is RunState.CANCELLED
    assert [line.status.value for line in settled.lines] == ["committed"]


async def test_with_no_owner_left_that_can_go_on_nothing_is_written(
    ledger: stopline.Ledger,
) -> None:
    """``B`` completed before ``A``'s cancel: ``S`` is ended as before, and its log says
    nothing of owners it was left to."""
    async with ledger.run("b", owner="u", run_id="B") as b:
        pass
    assert await _a_cancelled_around_s(ledger, b.id) == ["interrupted"]
    assert (await ledger.reads.run("S")).state is RunState.FAILED
    assert await _left(ledger.backend, "S") == []


async def test_only_owners_by_a_share_that_can_go_on_hold_it(ledger: stopline.Ledger) -> None:
    """``Backend.leave_to_owners`` on each case: an owner by a share running or paused
    holds the run (and the event names it); one completed, or a run owned alone, or a
    run fenced already (its last owner's cancel came first), is left to nobody, and
    nothing is written."""
    backend = ledger.backend
    for spec in (
        run_spec("A"),
        run_spec("B"),
        run_spec("S", parent_id="A", shared=True),
        run_spec("X", parent_id="B"),
        run_spec("C"),
        run_spec("T", parent_id="C", shared=True),
    ):
        await backend.create_run(spec)
    await backend.add_owner("S", "B", exclusive=False, by="u")
    await backend.add_owner("T", "B", exclusive=False, by="u")
    await backend.cancel("A", by="u")  # lets S go on for B
    assert await backend.leave_to_owners("S", cut_by="A") == ["B"]
    assert await backend.leave_to_owners("X", cut_by="A") == []  # B owns it alone
    await backend.pause("B", by="u")
    assert (await backend.get_run("B")).state is RunState.PAUSED
    assert await backend.leave_to_owners("S", cut_by="A") == ["B"]  # paused: resumable
    assert await _left(backend, "S") == [{"cut_by": "A", "owners": ["B"]}] * 2
    await backend.resume("B", by="u")
    await backend.run_event("B", RunEvent.COMPLETE, by="u")
    assert await backend.leave_to_owners("S", cut_by="A") == []  # nobody can go on
    await backend.cancel("C", by="u")  # lets T go on for B, which completed
    assert await backend.leave_to_owners("T", cut_by="C") == []
    assert await _left(backend, "X") == await _left(backend, "T") == []
    assert len(await _left(backend, "S")) == 2


async def test_a_fenced_run_is_left_to_nobody(ledger: stopline.Ledger) -> None:
    """The last owner's cancel fenced the run before its block's end was written: the
    block ends it as before, and nothing says it goes on."""
    backend = ledger.backend
    for spec in (run_spec("A"), run_spec("B"), run_spec("S", parent_id="A", shared=True)):
        await backend.create_run(spec)
    await backend.add_owner("S", "B", exclusive=False, by="u")
    await backend.cancel("A", by="u")
    await backend.cancel("B", by="u")  # its last owner: S fenced with it
    assert (await backend.get_run("S")).state.fenced
    assert await backend.leave_to_owners("S", cut_by="A") == []
    assert await _left(backend, "S") == []


async def test_a_lost_reply_leaves_it_once_on_postgres(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event commits and the server ends the connection before the reply: the retry
    finds this attempt's event and answers with its owners; one event, not two."""
    backend = await PostgresBackend.open(pg_url + "&retry_for=30")
    try:
        for spec in (run_spec("A"), run_spec("B"), run_spec("S", parent_id="A", shared=True)):
            await backend.create_run(spec)
        await backend.add_owner("S", "B", exclusive=False, by="u")
        await backend.cancel("A", by="u")
        ended = commit_reply_lost_once(backend, monkeypatch)
        assert await backend.leave_to_owners("S", cut_by="A") == ["B"]
        assert ended
        assert await _left(backend, "S") == [{"cut_by": "A", "owners": ["B"]}]
    finally:
        await backend.close()
