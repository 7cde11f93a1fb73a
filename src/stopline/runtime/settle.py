"""After a cancel: ask providers (``provider_asks``), verify unknowns, settle the run.

``advance`` moves a cancelled run along ``cancelling -> settling ->
cancelled | needs_review`` as the evidence comes in; it is safe to call at
any time and from many places. One task takes the steps (``Batches``, ADR
0037): the runs asked for while a step is under way are read together and
moved together in the next, so a run is never in two steps at once and each
step acts on what it read. Verification only reads (R5); the read-backs that
wake together read their operations together and record their verdicts in
one transaction. An operation whose read-back budget is spent, or whose tool
has no verifier, goes to review. A cancelled run's committed operations
whose tool declares ``compensation=always`` are corrected before the run
settles (S8).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import anyio

from stopline.domain.lifecycle import SYSTEM
from stopline.domain.model import Evidence, OperationRecord, RunRecord
from stopline.domain.transitions import FINAL_RUN_STATES, settle_move, settling_statuses
from stopline.domain.vocab import (
    EvidenceKind,
    NoteKind,
    OpEvent,
    OpStatus,
    RunEvent,
    RunState,
)
from stopline.errors import UnknownRun, describe
from stopline.ledger.backend import OutcomeUpdate
from stopline.runtime.batches import Batches
from stopline.runtime.compensate import context_for
from stopline.runtime.context import CallContext
from stopline.runtime.provider_asks import ProviderAsks
from stopline.runtime.readback import (
    READS_AT_ONCE,
    STILL_SENDING,
    VerifyBudget,
    ask,
    read_back_of,
    sender_may_still_send,
)
from stopline.runtime.tool import ReadBack, Verdict

if TYPE_CHECKING:
    from stopline.runtime.core import Core

__all__ = ["Settler", "VerifyBudget"]


_FINAL_KEPT = 4096
_CANCELLED = frozenset({RunState.CANCELLING, RunState.SETTLING, RunState.NEEDS_REVIEW})
# the moves that end a cancelled run's settling, if its tree has settled
_ENDS = frozenset({RunEvent.SETTLED, RunEvent.REVIEWED})
# the moves its owner waits for (its tree settled, or gone to review)
_OWNER_WAKES = frozenset({RunEvent.SETTLED, RunEvent.REVIEWED, RunEvent.ESCALATE})
# the states no step moves a run out of; its calls still count in its owners' settle
# (``unsettled_below``): a step asked for by a change of one wakes them. A correction
# that ended in a cancelled grandchild left its root ``settling`` for ever.
_SETTLED = FINAL_RUN_STATES | {RunState.CANCELLED}
# the states a step moves: a cancelled run's, and a settled one's, whose call (or whose
# tree's) went back to review when later evidence contradicted it (ADR 0093)
_STEPPED = _CANCELLED | {RunState.CANCELLED}


def _settled_unmoved(run: RunRecord, move: RunEvent | None) -> bool:
    """A settled run its own calls do not move: its tree may (``settle_move``)."""
    return run.state is RunState.CANCELLED and move is None


def _owners_unread(ended: RunRecord) -> bool:
    """A run that ended on its own wakes its parent unread if no cancel ever fenced it:
    the common path (a one-call run whose outcome lands after its block), which reads
    nothing. An owner other than its parent holds a run exclusively only by a last
    owner's cancel that fenced it (``fence._closure`` keeps that link, exclusive, in the
    fence's transaction; ADR 0065), and a fence is never taken back (a resume keeps the
    generation). A run fenced before, resumed since, may be such an owner's tree: its
    owners are read, as a cancelled run's are."""
    return ended.fence == 0


class Settler:
    def __init__(self, core: Core) -> None:
        self._core = core
        # runs waiting for the next step: another request for one is redundant, as that
        # step reads the state when it begins (a cancelled tree asks often)
        self._wanted: set[str] = set()
        self._steps: Batches[str, Exception | None] = Batches(core, self._step)
        # verifications read their operations together (a tree's wake at one moment)
        self._reads: Batches[str, OperationRecord] = Batches(
            core, lambda op_ids: core.backend.get_operations(op_ids)
        )
        self._not_yet: set[str] = set()  # ops a read-back found nothing for, before the horizon
        self.read_slots = anyio.CapacityLimiter(READS_AT_ONCE)
        self._verifying: dict[str, anyio.Event] = {}  # op id -> set when its verification ends
        # run id -> work under way that asks for the run's step when it ends (a provider's
        # answer awaited, the record of calls a cancel cut): no step reads it meanwhile
        self._held: dict[str, int] = {}
        self._asks = ProviderAsks(core, self)
        # runs this process ended (completed, failed; the latest _FINAL_KEPT): no step reads
        # them again, but their owners' does (their calls are in its receipt)
        self._final: dict[str, RunRecord] = {}
        self.busy = 0  # background steps running now
        self._idle = anyio.Event()  # set while ``busy`` is 0
        self._idle.set()

    @contextlib.asynccontextmanager
    async def working(self) -> AsyncIterator[None]:
        """Count a background step while it runs."""
        if self.busy == 0:
            self._idle = anyio.Event()
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            if self.busy == 0:
                self._idle.set()

    @property
    def verifying(self) -> int:
        """Operations this process is verifying now (or has queued to)."""
        return len(self._verifying)

    async def wait_idle(self) -> None:
        """Until no background step runs (returns at once if none does)."""
        while self.busy:
            await self._idle.wait()

    def hold_steps(self, run_ids: Iterable[str]) -> Callable[[], None]:
        """No step reads these runs until the returned release is called (once: later
        calls do nothing); whoever holds them asks for their step after. A cancel holds
        the runs whose calls it interrupted while it records them (a step meanwhile,
        asked by a run block's end, would read calls still in flight and move nothing);
        a provider's cancel request holds its run until the answer is in."""
        held = list(dict.fromkeys(run_ids))
        counts = self._held
        for run_id in held:
            counts[run_id] = counts.get(run_id, 0) + 1

        def release() -> None:
            while held:
                if (left := counts[run_id := held.pop()] - 1) == 0:
                    del counts[run_id]
                else:
                    counts[run_id] = left

        return release

    # -- providers ---------------------------------------------------------------
    def ask_provider_cancel(self, ctx: CallContext, *, cut: bool = False) -> anyio.Event | None:
        """Deliver a cancel request to a call in flight (``ProviderAsks.ask``): what was
        asked, how, and what came back recorded (R14); ``cut``: the call's awaiting
        scope was cut. Returns, when the provider is asked, an event set once the
        request is recorded and handed to it (or could not be)."""
        return self._asks.ask(ctx, cut=cut)

    # -- verification (R5: reads only) -----------------------------------------------
    def can_verify_here(self, op: OperationRecord) -> bool:
        """A read-back (or, with no verifier declared, an escalation) is possible here."""
        return op.tool in self._core.tools or not op.can_verify

    def verify_soon(self, op: OperationRecord) -> None:
        if op.id in self._verifying or not self.can_verify_here(op):
            return  # in hand already; or not verifiable from this process: a reconcile takes it
        self._verifying[op.id] = anyio.Event()
        self._core.spawn(self._verify, op, None)

    async def verify_with_budget(
        self, op: OperationRecord, budget: VerifyBudget | None = None
    ) -> OperationRecord:
        """Verify until proven, escalated or settled meanwhile; join one already running."""
        running = self._verifying.get(op.id)
        if running is not None:
            await running.wait()
            return await self._core.backend.get_operation(op.id)
        if not self.can_verify_here(op):
            return op
        self._verifying[op.id] = anyio.Event()
        return await self._verify(op, budget)

    async def _verify(self, op: OperationRecord, budget: VerifyBudget | None) -> OperationRecord:
        core = self._core
        current = op
        try:
            async with self.working():
                delays = (budget or core.verify_budget).delays()  # one at least
                reads = 0  # each read-back reads the operation first: ``op`` may be stale
                attempt, left = op.attempts, list(delays)
                while left:
                    await anyio.sleep(left.pop(0))  # a provider still finishing gets this long
                    current, done = await self._one_read(current, budget)
                    reads += 1
                    if done:
                        return current
                    if current.attempts != attempt:  # sent again, in doubt again: its own
                        attempt, left, reads = current.attempts, list(delays), 0  # ADR 0099
                # R13: budget spent before the horizon with a "not found yet": one more
                # look once it has passed (a verifier that cannot tell waits for no one)
                horizon = self.horizon_of(current)
                if op.id in self._not_yet and horizon is not None and horizon > time.time():
                    await anyio.sleep(horizon - time.time() + 0.001)
                    current, done = await self._one_read(current, budget)
                    reads += 1
                    if done:
                        return current
                spent = Evidence.local("verify_budget_spent", f"{reads} read-backs found no answer")
                return await core.outcomes.verdict(op.id, OutcomeUpdate(OpEvent.ESCALATED, [spent]))
        finally:
            self._not_yet.discard(op.id)
            done_event = self._verifying.pop(op.id, None)
            if done_event is not None:
                done_event.set()

    async def _one_read(
        self, op: OperationRecord, budget: VerifyBudget | None
    ) -> tuple[OperationRecord, bool]:
        """One read-back unless something else settled it; whether it is settled now."""
        current = await self._reads.one(op.id)
        if current.status is not OpStatus.UNKNOWN:
            return current, True
        current = await self.read_back(current, budget)
        return current, current.status is not OpStatus.UNKNOWN

    def horizon_of(self, op: OperationRecord) -> float | None:
        """R13: the recorded horizon, else the one its tool declares from the dispatch."""
        if op.horizon is not None:
            return op.horizon
        tool = self._core.tools.get(op.tool)
        if tool is None or tool.settles_within is None:
            return None
        return op.created_at + tool.settles_within

    def not_yet(self, op: OperationRecord, read: ReadBack, *, in_flight: bool = False) -> bool:
        """R13: a read-back that found nothing proves nothing while the effect can still
        land: before the horizon, unless the provider said the request ended. With no
        horizon stated or declared, the effect ends with the local call, unless that
        call is still ``in_flight`` (accepted, its worker waiting on it) or its sender
        may still send it (a worker crash recovery took for dead on a lapsed lease,
        ADR 0069): then no read-back can say "not committed"."""
        if read.verdict is not Verdict.NOT_COMMITTED or read.ended:
            return False
        horizon = self.horizon_of(op)
        if horizon is None:
            return in_flight or sender_may_still_send(op)
        return horizon > time.time()

    async def read_back(
        self, op: OperationRecord, budget: VerifyBudget | None = None
    ) -> OperationRecord:
        """One read-only look at the destination; records what it proves (R5)."""
        core = self._core
        tool, verify_fn = read_back_of(core.tools, op)
        if tool is None and op.can_verify:
            return op  # its tool is not registered here: leave it for one that has it
        if verify_fn is None:
            name = op.tool if tool is None else tool.name
            return await core.outcomes.verdict(
                op.id,
                OutcomeUpdate(
                    OpEvent.ESCALATED,
                    [Evidence.local("no_verifier", f"tool {name!r} has no read-back")],
                ),
            )
        assert tool is not None
        ctx = await context_for(core, op, tool)
        try:
            limit = (budget or core.verify_budget).read_timeout
            read = await ask(verify_fn, ctx, limit, self.read_slots)
        except Exception as exc:
            # kept as evidence: a verifier's error is part of why the outcome is in doubt
            failed = Evidence.local("verify_error", describe(exc))
            return await core.backend.note(
                op.id, NoteKind.VERIFY_FAILED, {"evidence": [failed.to_json()]}
            )
        if read.verdict is Verdict.UNKNOWN:
            if not read.detail:
                return await self._reads.one(op.id)
            # kept as evidence: why this look found no answer (a verifier's transport error)
            looked = Evidence(EvidenceKind.READ_BACK, read.ref or "read-back", read.detail)
            return await core.backend.note(
                op.id, NoteKind.VERIFY_UNKNOWN, {"evidence": [looked.to_json()]}
            )
        if self.not_yet(op, read):
            if self.horizon_of(op) is None:  # no end to wait for: kept as evidence, as no answer
                why = f"{read.detail or 'nothing found'}; {STILL_SENDING}"
                looked = Evidence(EvidenceKind.READ_BACK, read.ref or "read-back", why)
                return await core.backend.note(
                    op.id, NoteKind.VERIFY_UNKNOWN, {"evidence": [looked.to_json()]}
                )
            self._not_yet.add(op.id)
            return await self._reads.one(op.id)
        committed = read.verdict is Verdict.COMMITTED
        event = OpEvent.VERIFIED_COMMITTED if committed else OpEvent.VERIFIED_NOT_COMMITTED
        evidence = Evidence(EvidenceKind.READ_BACK, read.ref or "read-back", read.detail)
        return await core.outcomes.verdict(
            op.id,
            OutcomeUpdate(
                event,
                [evidence],
                result=read.result,
                has_result=committed and read.result is not None,
                attempt=op.attempts,  # what it looked for: refused once sent again (ADR 0099)
            ),
        )

    # -- the run -------------------------------------------------------------------
    async def advance(self, run_id: str) -> None:
        """Move a cancelled run towards settled, as far as the evidence allows."""
        await self.advance_many([run_id])

    async def advance_many(self, run_ids: Sequence[str]) -> None:
        """``advance`` for many runs. Runs asked for while a step is under way are
        stepped together in the next (a cancelled tree's runs settle together: one
        read, one write); a run already waiting for it is not asked again, as that
        step reads the ledger when it begins. Raises the first of these runs' errors."""
        fresh = [r for r in dict.fromkeys(run_ids) if r not in self._wanted]
        if not fresh:
            return
        self._wanted.update(fresh)
        try:
            async with self.working():
                errors = await self._steps.many(fresh)
        finally:
            self._wanted.difference_update(fresh)
        for error in errors:
            if error is not None:
                raise error

    def ended(self, run: RunRecord) -> bool:
        """This process moved ``run`` by itself (it completed or failed). True if nothing
        can leave its state: then there is nothing to settle, and no step of the settler
        reads it again."""
        if run.state not in FINAL_RUN_STATES:
            return False
        self._final[run.id] = run
        if len(self._final) > _FINAL_KEPT:
            del self._final[next(iter(self._final))]
        return True

    async def _owners(self, run_ids: list[str]) -> list[str]:
        """The runs whose trees ``run_ids`` are in now: their owners by exclusive links,
        read (a shared run stopped by its last owner's cancel is that owner's, not its
        parent's: ADR 0065)."""
        found = await self._core.backend.owners_of(run_ids)
        return [owner for held in found.values() for owner, alone in held.items() if alone]

    async def _step(self, run_ids: list[str]) -> list[Exception | None]:
        """One step of these runs: read them in one read, decide each run's move, write
        the moves in one transaction, then verify what is ``unknown``. Never two steps
        at once (one task serves them), so a run's move follows from what was read."""
        core = self._core
        self._wanted.difference_update(run_ids)  # from here on, what happens next is read
        errors: dict[str, Exception] = {}
        # the owners stepped again: of runs that ended by themselves (``owners``, unread;
        # ``read``: theirs read) and of cancelled runs whose move they wait for
        ready, owners, read = [], set(), []

        def wake(ended: RunRecord) -> None:
            if _owners_unread(ended):
                owners.add(ended.parent_id)
            else:
                read.append(ended.id)

        for run_id in run_ids:
            if (ended := self._final.get(run_id)) is not None:  # in a state nothing leaves
                wake(ended)
                continue
            local = core.runs.get(run_id)
            if local is not None and local.in_flight:
                continue  # local calls still running; their outcomes call us again
            if run_id not in self._held:  # else what holds it calls us again
                ready.append(run_id)
        moves: list[tuple[str, RunEvent]] = []
        unknown: list[OperationRecord] = []
        stepped: list[RunRecord] = []
        # what the step decides from: a run's open operations and those it may compensate
        found = await core.backend.runs_and_operations(ready, settling=True) if ready else []
        decided: list[tuple[RunRecord, set[OpStatus], RunEvent | None]] = []
        for run_id, got in zip(ready, found, strict=True):
            if isinstance(got, UnknownRun):
                errors[run_id] = got
                continue
            run, ops = got
            if run.state in _SETTLED:
                wake(run)
            if run.state not in _STEPPED or any(op.status.in_flight for op in ops):
                continue
            # the cancel's compensation policy, in review too: an outcome a reviewer or
            # later evidence settles as committed is corrected like one a read-back proved
            # (of a settled run: once it is in review again, ADR 0093)
            if run.state is not RunState.CANCELLED and await core.compensator.on_cancel(ops):
                ops = await core.backend.operations(run_id)
            stepped.append(run)
            move, verify = settle_move(run.state, statuses := settling_statuses(ops))
            decided.append((run, statuses, move))
            if verify:
                unknown.extend(op for op in ops if op.status is OpStatus.UNKNOWN)
        # after its tree; a settled run, its tree in review again, goes to review too
        final = [run.id for run, _, move in decided if move in _ENDS or _settled_unmoved(run, move)]
        below = await core.backend.unsettled_below(final) if final else {}
        for run, statuses, move in decided:
            if run.id in below:
                move, _ = settle_move(run.state, statuses, below[run.id])
            if move is not None:
                moves.append((run.id, move))
        if moves:
            # an illegal move: another process moved the run first
            await core.backend.run_events(moves, by=SYSTEM.id)
            # a run's owners wait for it (``unsettled_below``): they are stepped again
            read.extend(run_id for run_id, move in moves if move in _OWNER_WAKES)
        if read:  # one read for every run of the step whose owners are not its parent
            owners.update(await self._owners(sorted(read)))
        # an owner here not asked to cancel is not stepped: its cancel will step it
        woken = [o for o in owners if o and (o not in core.runs or core.runs[o].cancel_requested)]
        if woken:
            core.spawn(self.advance_many, sorted(woken))
        for op in unknown:
            self.verify_soon(op)
        for run in stepped:
            core.changed(run.id)
        return [errors.get(run_id) for run_id in run_ids]
