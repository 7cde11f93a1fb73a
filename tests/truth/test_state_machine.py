"""R1-R8 under random interleavings, checked after every step (Hypothesis, derandomized).

The machine plays both sides of a real SQLite ledger: the runtime (gate,
acceptance, responses, lost answers, cancel, verify, compensate, reconcile,
crash and restart) and a remote provider with its own ground truth (it may
hold a request, commit it, drop it, answer late). After every step the
ledger's background work is drained, then the rules are checked against the
provider's truth.
"""

from __future__ import annotations

import functools
import itertools
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import stopline
from stopline import Headline, OpStatus, Principal, ReadBack, RunState, Verdict, VerifyBudget
from stopline.domain.model import Evidence, OperationRecord, OperationSpec
from stopline.domain.vocab import Cancellable, OpEvent
from stopline.ledger.backend import GateVerdict, OutcomeUpdate, RunSpec
from tests.domain.test_receipt import op as record
from tests.truth.helpers import quiesce

OWNER = Principal("user:1", tenant="t")  # the runs' owner, in their tenant (R11)

_DOUBT = {OpStatus.NEEDS_REVIEW, OpStatus.COMPENSATION_FAILED}
_EFFECTED = {OpStatus.COMMITTED, OpStatus.COMPENSATING, OpStatus.COMPENSATED}


def expected_headline(state: RunState, ops: list[OperationRecord]) -> Headline:
    """R8's precedence, written again independently of ``receipt.headline_for``."""
    everything = {op.status for op in ops}
    primary = {op.status for op in ops if op.compensates is None}
    if everything & _DOUBT or state is RunState.NEEDS_REVIEW:
        return Headline.NEEDS_REVIEW
    if OpStatus.UNKNOWN in everything:
        return Headline.VERIFYING
    if state not in (RunState.CANCELLING, RunState.SETTLING, RunState.CANCELLED):
        return {RunState.COMPLETED: Headline.COMPLETED, RunState.FAILED: Headline.FAILED}.get(
            state,
            Headline.PAUSED if state in (RunState.PAUSED, RunState.PAUSING) else Headline.RUNNING,
        )
    in_flight = (OpStatus.REQUESTED, OpStatus.ACCEPTED)
    if any(op.status in in_flight and not _vendor_asked(op) for op in ops if not op.compensates):
        return Headline.VERIFYING  # R14: no vendor confirmation is awaited of an unasked call
    for status, headline in [
        (OpStatus.REQUESTED, Headline.AWAITING_CONFIRMATION),
        (OpStatus.ACCEPTED, Headline.AWAITING_CONFIRMATION),
        (OpStatus.COMPENSATING, Headline.CORRECTION_QUEUED),
        (OpStatus.COMMITTED, Headline.STOPPED_WITH_COMPLETED_ACTIONS),
        (OpStatus.COMPENSATED, Headline.CORRECTED),
    ]:
        if status in primary:
            return headline
    return Headline.CANCELED_BEFORE_EXTERNAL_ACTION


def _vendor_asked(op: OperationRecord) -> bool:
    """Its provider was asked to cancel it, or, not asked yet, still can be (R14)."""
    said = str(op.cancel_state)
    if said in ("asked", "refused", "unanswered", "error", "acknowledged", "confirmed"):
        return True
    if said not in ("not_asked", "none"):
        return False
    if op.status is OpStatus.REQUESTED:
        return op.cancellable is not Cancellable.NEVER
    return op.cancellable is Cancellable.AFTER_ACCEPTED


class Provider:
    """The remote's truth. Writes reach it only through the machine's ``dispatch``."""

    def __init__(self) -> None:
        self.received: Counter[str] = Counter()
        self.effects: Counter[str] = Counter()
        self.holding: set[str] = set()  # received, may still commit
        self.undone: set[str] = set()
        self.tool: stopline.Tool[Any] = stopline.Tool(self._never, name="remote")
        self.tool.verify_fn = self._verify
        self.tool.compensate_fn = self._compensate
        self.tool.compensation_verify_fn = self._verify_correction

    async def _never(self, *args: Any) -> None:
        raise AssertionError("R5: nothing may send a write but the workflow")

    async def _verify(self, ctx: stopline.CallContext) -> ReadBack:
        if self.effects[ctx.key]:
            return ReadBack(Verdict.COMMITTED, ctx.key)
        if ctx.key in self.holding:
            return ReadBack(Verdict.UNKNOWN, detail="still working")
        return ReadBack(Verdict.NOT_COMMITTED, detail="no such key")

    async def _compensate(self, ctx: stopline.CallContext) -> str:
        self.undone.add(str(getattr(ctx, "compensates", "")))
        return "undone"

    async def _verify_correction(self, ctx: stopline.CallContext) -> ReadBack:
        original = str(getattr(ctx, "compensates", ""))
        return ReadBack(Verdict.COMMITTED if original in self.undone else Verdict.NOT_COMMITTED)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="stopline-sm-")
        self.url = f"sqlite:///{self.dir}/ledger.db?synchronous=NORMAL"
        self.portal_cm = start_blocking_portal("asyncio")
        self.portal: BlockingPortal = self.portal_cm.__enter__()
        self.provider = Provider()
        self.ledger = self._open()
        self.runs: list[str] = []
        self.ops: dict[str, OperationRecord] = {}
        self.awaiting: set[str] = set()  # the local side still waits for an answer
        self.answers: set[str] = set()  # committed at the provider, response not delivered
        self.late: set[str] = set()  # responses delivered after the answer was lost

    def _open(self) -> stopline.Ledger:
        """Open a ledger held by one task of the portal (a task group lives in one task)."""
        budget = VerifyBudget(attempts=1, first_delay=0.0)
        ledger = stopline.open(self.url, verify=budget, tools=[self.provider.tool])
        self.stop = anyio.Event()
        ready = anyio.Event()

        async def hold() -> None:
            async with ledger:
                ready.set()
                await self.stop.wait()

        self.held = self.portal.start_task_soon(hold)
        self.portal.call(ready.wait)
        return ledger

    def _close(self) -> None:
        self.portal.call(self.stop.set)
        self.held.result(timeout=30)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.portal.call(functools.partial(fn, *args, **kwargs))

    def teardown(self) -> None:
        self._close()
        self.portal_cm.__exit__(None, None, None)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _with(self, *statuses: OpStatus) -> list[str]:
        return sorted(i for i, op in self.ops.items() if op.status in statuses and "~" not in i)

    def _resolve(self, op_id: str, event: OpEvent, **kw: Any) -> None:
        update = OutcomeUpdate(event, [Evidence.local(event.value)], **kw)
        self.call(self.ledger.core.outcomes.resolve, op_id, update)

    # -- the runtime's side -----------------------------------------------------
    @rule()
    def new_run(self) -> None:
        run_id = f"run_{len(self.runs)}"
        spec = RunSpec(id=run_id, name="job", owner="user:1", tenant="t")
        self.call(self.ledger.backend.create_run, spec)
        self.runs.append(run_id)

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def dispatch(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self.runs))
        op_id = f"{run_id}/{len(self.ops)}"
        spec = OperationSpec(
            id=op_id,
            run_id=run_id,
            tool="remote",
            args_digest="d",
            description="write",
            cancellable=Cancellable.NEVER,
            can_verify=True,
            can_compensate=True,
            worker=self.ledger.worker_id,
        )
        if self.call(self.ledger.backend.gate, spec).verdict is GateVerdict.PASSED:
            self.provider.received[op_id] += 1  # the first byte leaves after the gate
            self.provider.holding.add(op_id)
            self.awaiting.add(op_id)

    @precondition(lambda self: self.awaiting)
    @rule(data=st.data())
    def accept(self, data: st.DataObject) -> None:
        op_id = data.draw(st.sampled_from(sorted(self.awaiting)))
        if op_id in self.provider.holding:
            self._resolve(op_id, OpEvent.ACCEPTED)

    @precondition(lambda self: self.awaiting)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        """A local abort, timeout or disconnect: the answer is lost (R3)."""
        op_id = data.draw(st.sampled_from(sorted(self.awaiting)))
        self.awaiting.discard(op_id)
        self._resolve(op_id, OpEvent.LOST)

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        self.call(self.ledger.cancel, data.draw(st.sampled_from(self.runs)), by=OWNER)

    @precondition(lambda self: self._with(OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW))
    @rule(data=st.data())
    def verify(self, data: st.DataObject) -> None:
        op_id = data.draw(st.sampled_from(self._with(OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)))
        self.call(self.ledger.verify, op_id)

    @precondition(lambda self: self._with(OpStatus.COMMITTED))
    @rule(data=st.data())
    def compensate(self, data: st.DataObject) -> None:
        op_id = data.draw(st.sampled_from(self._with(OpStatus.COMMITTED)))
        self.portal.call(lambda: self.ledger.compensate(op_id, by=OWNER))

    @rule()
    def reconcile(self) -> None:
        self.call(self.ledger.reconcile)

    @rule()
    def crash(self) -> None:
        """The process dies; a new one starts on the same file and recovers (R2)."""
        self._close()
        self.awaiting.clear()
        self.ledger = self._open()
        self.call(quiesce, self.ledger)
        stuck = [
            op.id
            for op in self._all()
            if op.status.in_flight and op.worker != self.ledger.worker_id
        ]
        assert not stuck, f"R2: left in flight by the dead worker: {stuck}"

    # -- the provider's side ----------------------------------------------------
    @precondition(lambda self: self.provider.holding)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        op_id = data.draw(st.sampled_from(sorted(self.provider.holding)))
        self.provider.holding.discard(op_id)
        self.provider.effects[op_id] += 1
        self.answers.add(op_id)

    @precondition(lambda self: self.provider.holding)
    @rule(data=st.data(), say_so=st.booleans())
    def refuse(self, data: st.DataObject, say_so: bool) -> None:
        """The provider gives up before committing; it says so only if someone listens."""
        op_id = data.draw(st.sampled_from(sorted(self.provider.holding)))
        self.provider.holding.discard(op_id)
        if say_so and op_id in self.awaiting:
            self.awaiting.discard(op_id)
            self._resolve(op_id, OpEvent.REJECTED)

    @precondition(lambda self: self.answers)
    @rule(data=st.data())
    def respond(self, data: st.DataObject) -> None:
        """The response arrives: on time, or late after the answer was lost (R4)."""
        op_id = data.draw(st.sampled_from(sorted(self.answers)))
        self.answers.discard(op_id)
        if op_id in self.awaiting:
            self.awaiting.discard(op_id)
            self._resolve(op_id, OpEvent.COMMITTED, result="ok", has_result=True)
        else:
            self.late.add(op_id)
            self.call(lambda: self.ledger.late_response(op_id, Verdict.COMMITTED, result="ok"))

    # -- after every step ---------------------------------------------------------
    def _all(self) -> list[OperationRecord]:
        out: list[OperationRecord] = []
        for run_id in self.runs:
            out.extend(self.call(self.ledger.backend.operations, run_id))
        return out

    @invariant()
    def rules_hold(self) -> None:
        self.call(quiesce, self.ledger)
        ops = self._all()
        self.ops = {op.id: op for op in ops}
        truth = self.provider
        for op in ops:
            if op.compensates is not None:
                assert op.status is not OpStatus.COMMITTED or op.compensates in truth.undone
                continue
            assert truth.effects[op.id] <= 1, "R5: an effect happened twice"
            assert truth.received[op.id] <= 1, "R5: a write was sent twice"
            if op.status is OpStatus.NOT_COMMITTED:
                assert not truth.effects[op.id], f"R3: {op.id} not_committed but it happened"
            if op.status in _EFFECTED:
                assert truth.effects[op.id], f"R8: {op.id} {op.status} without an effect"
        for run_id in self.runs:
            run = self.call(self.ledger.backend.get_run, run_id)
            events = self.call(self.ledger.backend.events, run_id)
            cancels = [e.seq for e in events if e.kind == "cancel"]
            assert len(cancels) <= 1, "R7: one cancellation"
            if cancels:
                passed = [e.seq for e in events if e.kind == "gate_passed" and "~" not in e.op_id]
                assert all(seq < cancels[0] for seq in passed), "R1: dispatch after the fence"
            late_kept = {e.op_id for e in events if e.data.get("late")}
            mine = {op_id for op_id in self.late if op_id.startswith(f"{run_id}/")}
            assert mine <= late_kept, "R4: a late response was not kept"
            receipt = self.call(self.ledger.receipt, run_id)
            run_ops = [op for op in ops if op.run_id == run_id]
            assert receipt.headline is expected_headline(run.state, run_ops), "R8"


LedgerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=25,
    derandomize=True,
    deadline=None,
    database=None,
)
# 60 derandomized examples of 25 steps take one to two minutes on a quiet
# 2-core machine: more than the suite's 60 s default, so this test has its own bound.
test_state_machine = pytest.mark.timeout(600)(LedgerMachine.TestCase)


# The statuses of a cancelled run's operation that justify each headline of R8.
_JUSTIFIES = {
    Headline.NEEDS_REVIEW: OpStatus.NEEDS_REVIEW,
    Headline.VERIFYING: OpStatus.UNKNOWN,
    Headline.AWAITING_CONFIRMATION: OpStatus.REQUESTED,  # cancellable until accepted
    Headline.CORRECTION_QUEUED: OpStatus.COMPENSATING,
    Headline.STOPPED_WITH_COMPLETED_ACTIONS: OpStatus.COMMITTED,
    Headline.CORRECTED: OpStatus.COMPENSATED,
    Headline.CANCELED_BEFORE_EXTERNAL_ACTION: OpStatus.NOT_COMMITTED,
}


def _documented_precedence() -> list[Headline]:
    """R8's precedence as docs/contract.md writes it ("worst first: a > b > ...")."""
    text = " ".join((Path(__file__).parents[2] / "docs" / "contract.md").read_text().split())
    found = re.search(r"\*\*R8 .*?worst first: (.*?)\.\s", text)
    assert found is not None, "R8's precedence is no longer in docs/contract.md"
    return [Headline(word.strip()) for word in found.group(1).split(">")]


def test_expected_headline_matches_the_docs() -> None:
    """The machine's own R8 oracle follows the documented precedence: of any two
    outcomes on a cancelled run, the one written first in the contract wins."""
    precedence = _documented_precedence()
    assert set(precedence) == set(_JUSTIFIES)
    for worse, better in itertools.combinations(precedence, 2):
        ops = [record(_JUSTIFIES[headline], n=n) for n, headline in enumerate((better, worse))]
        assert expected_headline(RunState.CANCELLED, ops) is worse, (worse, better)
    assert expected_headline(RunState.CANCELLED, []) is precedence[-1]
