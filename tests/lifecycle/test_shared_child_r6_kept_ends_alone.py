"""R6: a kept child that ends on its own wakes its owner, not its creator (ADR 0065).

Shared child ``S`` (created by ``A``, shared with ``B``). ``A``'s cancel lets it go;
``B``'s, the last owner's, fences it and keeps ``B``'s link, exclusive: ``S`` is
``B``'s tree from then. ``B`` is resumed, and ``S`` with it; ``S``'s block then ends
on its own (``completed``) with its call in doubt, and ``B`` is cancelled again. ``B``
waits for ``S``'s call (``unsettled_below``); once its read-back settles it, ``S``'s
step must wake ``B``. Before, it woke its creator ``A`` (unread: a run that ended on
its own was taken to be in no tree but its parent's), and ``B`` stayed ``settling``
until a step was asked of it (a worker's next start): ``wait_settled("B")`` timed out.

A run never fenced is in no tree but its parent's: its step wakes its parent without
reading its owners (the common path: a one-call run whose outcome lands after its
block). Barriers, never sleeps: the read-back waits for the test, and a backend
observer tells when ``B``'s settle has written its move. On SQLite and PostgreSQL; a
second ``stopline.open`` of the ledger stands for another process.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

import stopline
from stopline import ReadBack, RunState, Verdict
from stopline.domain.model import RunRecord
from stopline.domain.vocab import RunEvent
from stopline.errors import IllegalTransition, UnknownRun
from stopline.ledger.backend import Backend, RunSpec
from stopline.ledger.forwarding import ForwardingBackend
from tests.conftest import FAST_VERIFY
from tests.support.observed import open_observed
from tests.truth.helpers import quiesce

# a hang guard: with the fix, B settles as soon as S's read-back has answered; before
# it, B waited for a step nobody asked for (never, in this test)
_SETTLED_WITHIN = 20.0


class Seen(ForwardingBackend):
    """Tells when a settle's next move naming a run has been written, and which runs'
    owners the settler read."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self._next: dict[str, anyio.Event] = {}
        self.owners_read: list[str] = []

    def next_move(self, run_id: str) -> anyio.Event:
        """Set by the next move naming ``run_id`` written from now."""
        self._next[run_id] = anyio.Event()
        return self._next[run_id]

    async def run_events(
        self, items: Sequence[tuple[str, RunEvent]], *, by: str
    ) -> list[tuple[RunRecord, bool] | IllegalTransition | UnknownRun]:
        written = await self.inner.run_events(items, by=by)
        for run_id, _ in items:
            if run_id in self._next:
                self._next.pop(run_id).set()
        return written

    async def owners_of(self, run_ids: Sequence[str]) -> dict[str, dict[str, bool]]:
        self.owners_read.extend(run_ids)
        return await self.inner.owners_of(run_ids)


class Deploy:
    """A deploy whose connection drops (in doubt, R3), whose read-back waits for the
    test, then finds it done."""

    def __init__(self, name: str = "deploy") -> None:
        self.reading, self.answer = anyio.Event(), anyio.Event()
        self.tool = stopline.Tool(self._deploy, name=name)
        self.tool.verifier(self._read)

    async def _deploy(self, ctx: stopline.CallContext) -> None:
        raise ConnectionError("dropped before the answer")

    async def _read(self, ctx: stopline.CallContext) -> ReadBack:
        self.reading.set()
        await self.answer.wait()
        return ReadBack(Verdict.COMMITTED, "deploy:log", "deployed", ended=True)


async def _call_in_doubt(
    ledger: stopline.Ledger, run_id: str, deploy: Deploy, parent_id: str | None = None
) -> None:
    """``run_id``'s block makes the deploy, its answer lost, and ends on its own, its
    call being read back."""
    async with ledger.run(run_id.lower(), owner="u", run_id=run_id, parent_id=parent_id) as run:
        with pytest.raises(ConnectionError):
            await run.call(deploy.tool, key="deploy")
    assert (await ledger.reads.run(run_id)).state is RunState.COMPLETED
    await deploy.reading.wait()


async def _kept_then_resumed(ledger: stopline.Ledger) -> None:
    """``S`` kept by its last owner ``B``'s cancel, then resumed with ``B``."""
    backend = ledger.backend
    await backend.create_run(RunSpec(id="A", name="a", owner="u", tenant="default"))
    await backend.create_run(RunSpec(id="B", name="b", owner="u", tenant="default"))
    shared = RunSpec(id="S", name="s", owner="u", tenant="default", parent_id="A", shared=True)
    await backend.create_run(shared)
    await ledger.share("S", with_owner="B", by="u")
    await ledger.cancel("A", by="u")
    assert (await ledger.reads.run("S")).state is RunState.RUNNING  # B holds it
    await ledger.cancel("B", by="u")  # the last owner: S fenced, B's link kept
    receipt = await ledger.wait_settled("B", timeout=_SETTLED_WITHIN)
    assert receipt.run_state is RunState.CANCELLED
    await ledger.resume("B", by="u")
    assert (await ledger.reads.run("S")).state is RunState.RUNNING  # resumed with B


async def _settles_after_the_read_back(
    owner: stopline.Ledger, seen: Seen, deploy: Deploy
) -> list[tuple[str, str]]:
    """``B`` cancelled again (through ``owner``) while ``S``'s call is in doubt: it waits
    for the call; the read-back answers; ``B`` settles. Its receipt's lines."""
    moved = seen.next_move("B")
    await owner.cancel("B", by="u")  # again: S is B's tree, its call in doubt
    await moved.wait()  # B's settle has moved it
    assert (await owner.reads.run("B")).state is RunState.SETTLING  # waits for S's call
    deploy.answer.set()
    settled = await owner.wait_settled("B", timeout=_SETTLED_WITHIN)  # was: timed out
    assert settled.run_state is RunState.CANCELLED
    return [(line.op_id, line.status.value) for line in settled.lines]


async def test_a_kept_child_that_ends_on_its_own_wakes_its_owner(ledger_url: str) -> None:
    deploy = Deploy()
    async with open_observed(ledger_url, Seen) as (ledger, seen):
        await _kept_then_resumed(ledger)
        await _call_in_doubt(ledger, "S", deploy)
        lines = await _settles_after_the_read_back(ledger, seen, deploy)
        (op,) = await ledger.backend.operations("S")
        assert lines == [(op.id, "committed")]
        assert "S" in seen.owners_read  # its owners read: a cancel fenced it once
        assert (await ledger.receipt("A")).lines == ()  # its creator let it go


async def test_the_owner_in_another_process_is_woken_by_the_kept_childs_step(
    ledger_url: str,
) -> None:
    """``S``'s block and its read-back in one process, the cancels and the wait for
    ``B`` in another: ``S``'s step, where its call is read back, steps ``B`` there."""
    deploy = Deploy()
    async with (
        stopline.open(ledger_url, verify=FAST_VERIFY) as here,
        open_observed(ledger_url, Seen) as (there, seen),
    ):
        await _kept_then_resumed(there)
        await _call_in_doubt(here, "S", deploy)
        lines = await _settles_after_the_read_back(there, seen, deploy)
        assert [status for _, status in lines] == ["committed"]


async def test_a_run_never_fenced_wakes_its_parent_unread(ledger_url: str) -> None:
    """The common path reads nothing it does not need: a one-call root run ``R`` and a
    child ``C`` never shared, each ended on its own with its call in doubt, settled by
    the read-back after their blocks. ``C``'s step wakes its cancelled parent (which
    then settles: the step ran) without reading ``C``'s owners; ``R``'s step reads
    none either."""
    child, root = Deploy(), Deploy("deploy_root")
    async with open_observed(ledger_url, Seen) as (ledger, seen):
        await ledger.backend.create_run(RunSpec(id="P", name="p", owner="u", tenant="default"))
        await _call_in_doubt(ledger, "C", child, parent_id="P")
        await _call_in_doubt(ledger, "R", root)
        moved = seen.next_move("P")
        await ledger.cancel("P", by="u")
        await moved.wait()
        assert (await ledger.reads.run("P")).state is RunState.SETTLING  # waits for C's call
        child.answer.set()
        root.answer.set()
        settled = await ledger.wait_settled("P", timeout=_SETTLED_WITHIN)
        assert settled.run_state is RunState.CANCELLED
        assert [line.status.value for line in settled.lines] == ["committed"]
        await quiesce(ledger)  # R's step, after its call's verdict, has run
        assert [op.status.value for op in await ledger.backend.operations("R")] == ["committed"]
        assert "C" not in seen.owners_read and "R" not in seen.owners_read
        assert "P" in seen.owners_read  # a cancelled run's move: its owners are read


async def test_a_reconcile_elsewhere_reads_the_ended_child_and_wakes_its_owner(
    ledger_url: str,
) -> None:
    """The process where ``S`` ended is gone before its call is read back: a reconcile
    in another one settles the call, and its step reads ``S`` from the ledger (it did
    not end there), then wakes ``B``, not ``S``'s creator."""
    deploy = Deploy()
    async with open_observed(ledger_url, Seen) as (there, seen):
        await _kept_then_resumed(there)
        async with stopline.open(ledger_url, verify=FAST_VERIFY) as here:
            await _call_in_doubt(here, "S", deploy)
        moved = seen.next_move("B")
        await there.cancel("B", by="u")
        await moved.wait()
        assert (await there.reads.run("B")).state is RunState.SETTLING  # waits for S's call
        deploy.answer.set()
        summary = await there.reconcile(tools=[deploy.tool], budget=FAST_VERIFY)
        (op,) = await there.backend.operations("S")
        assert summary.committed == (op.id,)  # read back there
        settled = await there.wait_settled("B", timeout=_SETTLED_WITHIN)
        assert settled.run_state is RunState.CANCELLED
        assert [line.status.value for line in settled.lines] == ["committed"]
