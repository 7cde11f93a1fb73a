"""R6: a shared child's last owner waits for it, and counts its calls (ADR 0065, 4).

Before: shared child ``S`` (created by ``A``, shared with ``B``). ``A``'s cancel let it
go (it went on for ``B``: right); ``B``'s cancel, the last owner's, fenced it, but ``B``
became ``cancelled`` with an empty receipt while ``S``'s call was still being read
back. The cancel released ``B``'s link too, so nothing that reads a run's tree (its
settle, its receipt) found ``S`` under ``B``; and ``S``'s settle woke its creator
``A``, not ``B``. Now the last owner's cancel keeps its link, made exclusive: ``S`` is
``B``'s tree from then, ``B`` settles after it, and ``B``'s receipt counts its calls.
A shared child that had ended before its last owner's cancel is let go, as before:
that cancel stopped nothing of it.

Barriers, never sleeps: the read-back of ``S``'s call waits for the test, and a
backend observer tells when ``B``'s settle has written its move. On SQLite and
PostgreSQL; a second ``stopline.open`` of the ledger stands for another process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import anyio
import anyio.abc
import pytest

import stopline
from stopline import PhaseKind, Policy, ReadBack, RunState, Verdict
from stopline.domain.model import RunRecord
from stopline.domain.vocab import RunEvent
from stopline.errors import IllegalTransition, UnknownRun
from stopline.ledger.backend import Backend
from stopline.ledger.forwarding import ForwardingBackend
from tests.conftest import FAST_VERIFY


class Moves(ForwardingBackend):
    """Tells when a settle's moves naming a run have been written."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self._moved: dict[str, anyio.Event] = {}

    def moved(self, run_id: str) -> anyio.Event:
        return self._moved.setdefault(run_id, anyio.Event())

    async def run_events(
        self, items: Sequence[tuple[str, RunEvent]], *, by: str
    ) -> list[tuple[RunRecord, bool] | IllegalTransition | UnknownRun]:
        written = await self.inner.run_events(items, by=by)
        for run_id, _ in items:
            self.moved(run_id).set()
        return written


class Deploy:
    """A deploy that never answers, whose read-back waits for the test."""

    def __init__(self) -> None:
        self.sent, self.reading, self.answer = anyio.Event(), anyio.Event(), anyio.Event()
        self.tool = stopline.Tool(self._deploy, name="deploy")
        self.tool.verifier(self._read)

    async def _deploy(self, ctx: stopline.CallContext) -> None:
        self.sent.set()
        await anyio.sleep_forever()

    async def _read(self, ctx: stopline.CallContext) -> ReadBack:
        self.reading.set()
        await self.answer.wait()
        return ReadBack(Verdict.NOT_COMMITTED, "deploy:log", "no deploy", ended=True)


async def _owner(ledger: stopline.Ledger, run_id: str, opened: anyio.Event) -> None:
    async with ledger.run(run_id.lower(), owner="u", run_id=run_id):
        opened.set()
        await anyio.sleep_forever()


async def _shared_call(ledger: stopline.Ledger, deploy: Deploy) -> None:
    """``S``, created by ``A`` shared, shared with ``B``, its block in a task of its own
    (outside both owners' blocks: only a fence stops it), calling the deploy."""
    async with ledger.run("s", owner="u", run_id="S", parent_id="A", shared=True) as s:
        await ledger.share("S", with_owner="B", by="u")
        async with s.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
            await s.call(deploy.tool, key="deploy")


async def _owners_and_call(
    tg: anyio.abc.TaskGroup, owners: stopline.Ledger, shared: stopline.Ledger, deploy: Deploy
) -> None:
    """``A``'s and ``B``'s blocks open (through ``owners``), and ``S``'s call sent
    (through ``shared``)."""
    for run_id in ("A", "B"):
        opened = anyio.Event()
        tg.start_soon(_owner, owners, run_id, opened)
        await opened.wait()
    tg.start_soon(_shared_call, shared, deploy)
    await deploy.sent.wait()


@pytest.fixture
async def observed(ledger_url: str) -> AsyncIterator[tuple[stopline.Ledger, Moves]]:
    seen: list[Moves] = []

    def observe(backend: Backend) -> Backend:
        seen.append(Moves(backend))
        return seen[-1]

    async with stopline.open(ledger_url, verify=FAST_VERIFY, observers=[observe]) as ledger:
        yield ledger, seen[0]


async def test_the_last_owner_settles_after_its_shared_child(
    observed: tuple[stopline.Ledger, Moves],
) -> None:
    ledger, moves = observed
    deploy = Deploy()
    async with anyio.create_task_group() as tg:
        await _owners_and_call(tg, ledger, ledger, deploy)
        await ledger.cancel("A", by="u")
        assert (await ledger.reads.run("S")).state is RunState.RUNNING  # B holds it
        await ledger.cancel("B", by="u")  # the last owner: S fenced, its call cut
        await deploy.reading.wait()  # S's call in doubt, being read back
        await moves.moved("B").wait()  # B's settle has moved it
        (op,) = await ledger.backend.operations("S")
        assert (await ledger.reads.run("B")).state is RunState.SETTLING  # was: cancelled
        assert [line.op_id for line in (await ledger.receipt("B")).lines] == [op.id]
        assert (await ledger.receipt("A")).lines == ()  # A let it go: not A's
        released = [e.data for e in await ledger.backend.events("S") if e.kind == "owner_released"]
        assert released == [{"owner_cancelled": "A"}]  # B's link kept
        deploy.answer.set()
        settled = await ledger.wait_settled("B", timeout=30)  # S's settle wakes B
        assert settled.run_state is RunState.CANCELLED
        assert [(line.op_id, line.status.value) for line in settled.lines] == [
            (op.id, "not_committed")
        ]
        assert (await ledger.reads.run("S")).state is RunState.CANCELLED
        tg.cancel_scope.cancel()


async def test_the_owner_in_another_process_is_woken_by_the_childs_settle(
    ledger_url: str,
) -> None:
    """``S``'s block and its read-back in one process, ``B``'s block and both cancels in
    another: ``S``'s settle, where its call is read back, steps ``B`` there."""
    deploy = Deploy()
    async with (
        stopline.open(ledger_url, verify=FAST_VERIFY) as here,
        stopline.open(ledger_url, verify=FAST_VERIFY) as there,
        anyio.create_task_group() as tg,
    ):
        await _owners_and_call(tg, there, here, deploy)
        await there.cancel("A", by="u")
        await there.cancel("B", by="u")
        await deploy.reading.wait()
        deploy.answer.set()
        settled = await there.wait_settled("B", timeout=30)
        assert settled.run_state is RunState.CANCELLED
        assert [line.status.value for line in settled.lines] == ["not_committed"]
        tg.cancel_scope.cancel()


async def test_a_shared_child_ended_before_its_last_owners_cancel_is_let_go(
    ledger: stopline.Ledger,
) -> None:
    """Decided (ADR 0065): the last owner keeps a shared child its cancel stops. One
    that completed before is not stopped by it: the link is let go as by any owner,
    and the owner's settle and receipt are its own."""

    @stopline.tool
    async def note(ctx: stopline.CallContext) -> str:
        return "noted"

    async with ledger.run("b", owner="u", run_id="B") as b:
        async with ledger.run("a", owner="u", run_id="A"):
            async with ledger.run("s", owner="u", run_id="S", parent_id="A", shared=True) as s:
                await ledger.share("S", with_owner="B", by="u")
                await s.call(note)
            await ledger.cancel("A", by="u")
        assert (await ledger.reads.run("S")).state is RunState.COMPLETED
        await ledger.cancel(b.id, by="u")
    receipt = await ledger.wait_settled("B", timeout=30)
    assert receipt.run_state is RunState.CANCELLED and receipt.lines == ()
    released = [e.data for e in await ledger.backend.events("S") if e.kind == "owner_released"]
    assert released == [{"owner_cancelled": "A"}, {"owner_cancelled": "B"}]
