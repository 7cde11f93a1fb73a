"""The transition tables against the contract's diagrams (docs/contract.md), both ways.

Every arrow of the diagrams is a move of the table; every move of the table
is an arrow of the diagrams or is listed in ``BEYOND`` with the test that says
why it exists; every other (state, event) pair raises ``IllegalTransition``
naming both. The expected targets are written out here from the
specification, never read back from the table under test.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import pytest

from stopline.domain.model import EventRecord
from stopline.domain.transitions import (
    AGREES,
    CONTRADICTS,
    FINAL_RUN_STATES,
    OPERATION_TABLE,
    RUN_TABLE,
    apply,
    diagram,
    events_from,
    later_evidence_settles,
    review_entry,
    settle_move,
)
from stopline.domain.vocab import OpEvent, OpStatus, RunEvent, RunState
from stopline.errors import IllegalTransition

S, E = OpStatus, OpEvent
R, V = RunState, RunEvent

# docs/contract.md, "Operation status", arrow by arrow.
CONTRACT_OPERATION: Mapping[tuple[OpStatus, OpEvent], OpStatus] = {
    (S.NOT_STARTED, E.GATE_PASSED): S.REQUESTED,  # gate passes
    (S.NOT_STARTED, E.GATE_REFUSED): S.PREVENTED,  # gate refuses (fenced)
    (S.REQUESTED, E.ACCEPTED): S.ACCEPTED,  # provider acks
    (S.ACCEPTED, E.COMMITTED): S.COMMITTED,  # done
    (S.REQUESTED, E.LOST): S.UNKNOWN,  # no answer / disconnect / local abort
    (S.ACCEPTED, E.LOST): S.UNKNOWN,
    (S.REQUESTED, E.REJECTED): S.NOT_COMMITTED,  # provider refuses before commit
    (S.ACCEPTED, E.CANCEL_CONFIRMED): S.NOT_COMMITTED,  # provider confirms cancel
    (S.UNKNOWN, E.VERIFIED_COMMITTED): S.COMMITTED,  # verify
    (S.UNKNOWN, E.VERIFIED_NOT_COMMITTED): S.NOT_COMMITTED,
    (S.UNKNOWN, E.ESCALATED): S.NEEDS_REVIEW,  # budget spent
    (S.COMMITTED, E.COMPENSATION_STARTED): S.COMPENSATING,  # compensation
    (S.COMPENSATING, E.COMPENSATED): S.COMPENSATED,
    (S.COMPENSATING, E.COMPENSATION_FAILED): S.COMPENSATION_FAILED,
    (S.COMPENSATION_FAILED, E.ESCALATED): S.NEEDS_REVIEW,
}

# docs/contract.md, "Run state".
CONTRACT_RUN: Mapping[tuple[RunState, RunEvent], RunState] = {
    (R.RUNNING, V.PAUSE): R.PAUSING,
    (R.PAUSING, V.PAUSED): R.PAUSED,
    (R.PAUSED, V.RESUME): R.RUNNING,
    (R.RUNNING, V.CANCEL): R.CANCELLING,  # fence raised
    (R.CANCELLING, V.SETTLE): R.SETTLING,  # in-flight operations resolving
    (R.SETTLING, V.SETTLED): R.CANCELLED,
    (R.CANCELLING, V.ESCALATE): R.NEEDS_REVIEW,  # an outcome cannot be determined
    (R.SETTLING, V.ESCALATE): R.NEEDS_REVIEW,
    (R.RUNNING, V.COMPLETE): R.COMPLETED,  # runs that end on their own
    (R.RUNNING, V.FAIL): R.FAILED,
}

# Moves beyond the diagrams, each with the test below that says why.
BEYOND: Mapping[tuple[Any, Any], tuple[Any, str]] = {
    (S.NOT_COMMITTED, E.GATE_PASSED): (S.REQUESTED, "test_a_retry_keeps_its_id"),
    (S.PREVENTED, E.GATE_PASSED): (S.REQUESTED, "test_a_resumed_run_dispatches_what_was_prevented"),
    (S.REQUESTED, E.COMMITTED): (S.COMMITTED, "test_a_response_needs_no_acknowledgement"),
    (S.REQUESTED, E.NOT_SENT): (S.NOT_COMMITTED, "test_abandoned_before_the_first_byte"),
    (S.REQUESTED, E.CANCEL_CONFIRMED): (S.NOT_COMMITTED, "test_a_cancel_confirmed_before_ack"),
    (S.ACCEPTED, E.REJECTED): (S.NOT_COMMITTED, "test_a_refusal_after_the_ack"),
    (S.UNKNOWN, E.COMMITTED): (S.COMMITTED, "test_r4_a_late_answer_settles_an_unknown"),
    (S.UNKNOWN, E.REJECTED): (S.NOT_COMMITTED, "test_r4_a_late_answer_settles_an_unknown"),
    (S.UNKNOWN, E.CANCEL_CONFIRMED): (S.NOT_COMMITTED, "test_r4_a_late_answer_settles_an_unknown"),
    (S.COMMITTED, E.CONFLICT): (S.NEEDS_REVIEW, "test_contradicting_evidence_goes_to_a_human"),
    (S.NOT_COMMITTED, E.CONFLICT): (S.NEEDS_REVIEW, "test_contradicting_evidence_goes_to_a_human"),
    (S.COMPENSATING, E.CONFLICT): (S.NEEDS_REVIEW, "test_never_happened_contradicts_a_correction"),
    (S.COMPENSATED, E.CONFLICT): (S.NEEDS_REVIEW, "test_never_happened_contradicts_a_correction"),
    (S.COMPENSATION_FAILED, E.CONFLICT): (
        S.NEEDS_REVIEW,
        "test_never_happened_contradicts_a_correction",
    ),
    (S.NEEDS_REVIEW, E.REVIEWED_CORRECTED): (
        S.COMPENSATED,
        "test_a_corrected_action_found_to_happen",
    ),
    (S.NEEDS_REVIEW, E.COMMITTED): (S.COMMITTED, "test_evidence_after_escalation_settles_it"),
    (S.NEEDS_REVIEW, E.REJECTED): (S.NOT_COMMITTED, "test_evidence_after_escalation_settles_it"),
    (S.NEEDS_REVIEW, E.VERIFIED_COMMITTED): (
        S.COMMITTED,
        "test_evidence_after_escalation_settles_it",
    ),
    (S.NEEDS_REVIEW, E.VERIFIED_NOT_COMMITTED): (
        S.NOT_COMMITTED,
        "test_evidence_after_escalation_settles_it",
    ),
    (S.NEEDS_REVIEW, E.REVIEWED_COMMITTED): (S.COMMITTED, "test_a_reviewer_decides"),
    (S.NEEDS_REVIEW, E.REVIEWED_NOT_COMMITTED): (S.NOT_COMMITTED, "test_a_reviewer_decides"),
    (R.PAUSING, V.RESUME): (R.RUNNING, "test_a_pause_can_be_taken_back_before_it_lands"),
    (R.PAUSING, V.CANCEL): (R.CANCELLING, "test_a_paused_run_can_be_cancelled"),
    (R.PAUSED, V.CANCEL): (R.CANCELLING, "test_a_paused_run_can_be_cancelled"),
    (R.CANCELLING, V.SETTLED): (R.CANCELLED, "test_a_cancel_with_nothing_in_flight_settles"),
    (R.NEEDS_REVIEW, V.REVIEWED): (R.CANCELLED, "test_a_reviewed_run_ends_cancelled"),
    (R.PAUSING, V.COMPLETE): (R.COMPLETED, "test_a_workflow_ending_during_a_pause_ends_it"),
    (R.PAUSED, V.COMPLETE): (R.COMPLETED, "test_a_workflow_ending_during_a_pause_ends_it"),
    (R.PAUSING, V.FAIL): (R.FAILED, "test_a_workflow_ending_during_a_pause_ends_it"),
    (R.PAUSED, V.FAIL): (R.FAILED, "test_a_workflow_ending_during_a_pause_ends_it"),
    (R.RUNNING, V.ESCALATE): (R.NEEDS_REVIEW, "test_a_running_run_with_an_unknown_escalates"),
    (R.CANCELLED, V.RESUME): (R.RUNNING, "test_r10_a_cancelled_run_resumes_from_a_checkpoint"),
    (R.CANCELLED, V.ESCALATE): (
        R.NEEDS_REVIEW,
        "test_a_settled_cancel_is_reopened_by_its_evidence",
    ),
}


def _tables() -> list[tuple[Mapping[Any, Any], Mapping[Any, Any]]]:
    beyond_ops = {k: v for k, (v, _) in BEYOND.items() if isinstance(k[0], OpStatus)}
    beyond_runs = {k: v for k, (v, _) in BEYOND.items() if isinstance(k[0], RunState)}
    return [
        (OPERATION_TABLE, {**CONTRACT_OPERATION, **beyond_ops}),
        (RUN_TABLE, {**CONTRACT_RUN, **beyond_runs}),
    ]


@pytest.mark.parametrize(("source", "event"), list(CONTRACT_OPERATION))
def test_every_operation_arrow_of_the_contract_is_a_move(source: OpStatus, event: OpEvent) -> None:
    assert apply(OPERATION_TABLE, source, event) is CONTRACT_OPERATION[(source, event)]


@pytest.mark.parametrize(("source", "event"), list(CONTRACT_RUN))
def test_every_run_arrow_of_the_contract_is_a_move(source: RunState, event: RunEvent) -> None:
    assert apply(RUN_TABLE, source, event) is CONTRACT_RUN[(source, event)]


def test_no_move_beyond_the_contract_without_a_test_that_says_why() -> None:
    """The other way: each move of the tables is an arrow, or is named in ``BEYOND``."""
    for table, allowed in _tables():
        unexplained = {k: v for k, v in table.items() if allowed.get(k) is not v}
        assert unexplained == {}
    named = {test for (_target, test) in BEYOND.values()}
    assert named <= set(globals()), sorted(named - set(globals()))


def test_every_other_pair_is_illegal_and_names_itself() -> None:
    pairs = [
        *itertools.product(OpStatus, OpEvent),
        *itertools.product(RunState, RunEvent),
    ]
    checked = 0
    for (table, allowed), (state, event) in itertools.product(_tables(), pairs):
        if type(state) is not type(next(iter(table))[0]) or (state, event) in allowed:
            continue
        with pytest.raises(IllegalTransition) as info:
            apply(table, state, event)
        assert (info.value.state, info.value.event) == (state, event)
        assert state.value in str(info.value) and event.value in str(info.value)
        checked += 1
    assert checked == len(pairs) - len(CONTRACT_OPERATION) - len(CONTRACT_RUN) - len(BEYOND)


# -- why each move beyond the diagrams exists ------------------------------------------
def test_a_retry_keeps_its_id() -> None:
    """An id is an idempotency key: what provably did not commit may be sent again under it."""
    assert apply(OPERATION_TABLE, S.NOT_COMMITTED, E.GATE_PASSED) is S.REQUESTED


def test_a_resumed_run_dispatches_what_was_prevented() -> None:
    """R10: after a resume, the operation the fence prevented passes the gate (same id),
    and that is the only way out of ``prevented``."""
    assert events_from(OPERATION_TABLE, S.PREVENTED) == [E.GATE_PASSED]
    assert apply(OPERATION_TABLE, S.PREVENTED, E.GATE_PASSED) is S.REQUESTED


def test_a_response_needs_no_acknowledgement() -> None:
    """Most providers answer without acknowledging first: the response proves the effect."""
    assert apply(OPERATION_TABLE, S.REQUESTED, E.COMMITTED) is S.COMMITTED


def test_abandoned_before_the_first_byte() -> None:
    """Passed the gate, cancelled before anything was sent: provably no effect (not R3)."""
    assert apply(OPERATION_TABLE, S.REQUESTED, E.NOT_SENT) is S.NOT_COMMITTED


def test_a_cancel_confirmed_before_ack() -> None:
    """A provider may confirm a cancel before it ever acknowledged the request (S2)."""
    assert apply(OPERATION_TABLE, S.REQUESTED, E.CANCEL_CONFIRMED) is S.NOT_COMMITTED


def test_a_refusal_after_the_ack() -> None:
    """A provider may acknowledge, then refuse before committing."""
    assert apply(OPERATION_TABLE, S.ACCEPTED, E.REJECTED) is S.NOT_COMMITTED


def test_r4_a_late_answer_settles_an_unknown() -> None:
    """R4: a late response or cancel confirmation is evidence; it settles an ``unknown``."""
    assert apply(OPERATION_TABLE, S.UNKNOWN, E.COMMITTED) is S.COMMITTED
    assert apply(OPERATION_TABLE, S.UNKNOWN, E.REJECTED) is S.NOT_COMMITTED
    assert apply(OPERATION_TABLE, S.UNKNOWN, E.CANCEL_CONFIRMED) is S.NOT_COMMITTED


def test_contradicting_evidence_goes_to_a_human() -> None:
    """Evidence against a recorded outcome is never dropped and never overwrites it."""
    assert apply(OPERATION_TABLE, S.COMMITTED, E.CONFLICT) is S.NEEDS_REVIEW
    assert apply(OPERATION_TABLE, S.NOT_COMMITTED, E.CONFLICT) is S.NEEDS_REVIEW


def test_never_happened_contradicts_a_correction() -> None:
    """A corrected (or being corrected) operation rests on proof that it happened: proof
    that it did not goes to a human too, and the correction's own record stays."""
    for source in (S.COMPENSATING, S.COMPENSATED, S.COMPENSATION_FAILED):
        assert apply(OPERATION_TABLE, source, E.CONFLICT) is S.NEEDS_REVIEW
        for event in (E.REJECTED, E.CANCEL_CONFIRMED, E.VERIFIED_NOT_COMMITTED):
            assert source in CONTRADICTS[event]
    assert {S.COMPENSATING, S.COMPENSATED} <= AGREES[E.COMMITTED]  # proof it happened agrees


def test_a_corrected_action_found_to_happen() -> None:
    """A reviewer who finds that a corrected action happened leaves it corrected: its
    correction stands (``review.resolve`` records this move, not ``reviewed_committed``).
    Its own event: a correction's link (``compensated``) moves only what is being
    corrected, never an item a contradiction put in review meanwhile."""
    assert apply(OPERATION_TABLE, S.NEEDS_REVIEW, E.REVIEWED_CORRECTED) is S.COMPENSATED
    with pytest.raises(IllegalTransition):
        apply(OPERATION_TABLE, S.NEEDS_REVIEW, E.COMPENSATED)


def test_only_an_item_in_review_for_want_of_an_answer_is_settled_by_evidence() -> None:
    """ADR 0052: what put an operation in review is the status it entered it from."""

    def entered(*moves: tuple[OpStatus, OpStatus]) -> list[EventRecord]:
        return [
            EventRecord(n, 0.0, "run", "run/op", "x", a.value, b.value, {})
            for n, (a, b) in enumerate(moves)
        ]

    lost = entered((S.REQUESTED, S.UNKNOWN), (S.UNKNOWN, S.NEEDS_REVIEW))
    assert review_entry(lost) is S.UNKNOWN and later_evidence_settles(lost)
    note = [*lost, EventRecord(9, 0.0, "run", "run/op", "note", "needs_review", "needs_review", {})]
    assert review_entry(note) is S.UNKNOWN  # a note moves nothing
    disputed = entered(
        (S.UNKNOWN, S.NEEDS_REVIEW), (S.NEEDS_REVIEW, S.COMMITTED), (S.COMMITTED, S.NEEDS_REVIEW)
    )
    assert review_entry(disputed) is S.COMMITTED and not later_evidence_settles(disputed)
    failed = entered((S.COMPENSATION_FAILED, S.NEEDS_REVIEW))
    assert not later_evidence_settles(failed)
    assert not later_evidence_settles([])


def test_evidence_after_escalation_settles_it() -> None:
    """A review item is closed by proof that arrives late, as by a reviewer."""
    for event, target in [
        (E.COMMITTED, S.COMMITTED),
        (E.REJECTED, S.NOT_COMMITTED),
        (E.VERIFIED_COMMITTED, S.COMMITTED),
        (E.VERIFIED_NOT_COMMITTED, S.NOT_COMMITTED),
    ]:
        assert apply(OPERATION_TABLE, S.NEEDS_REVIEW, event) is target


def test_a_reviewer_decides() -> None:
    assert apply(OPERATION_TABLE, S.NEEDS_REVIEW, E.REVIEWED_COMMITTED) is S.COMMITTED
    assert apply(OPERATION_TABLE, S.NEEDS_REVIEW, E.REVIEWED_NOT_COMMITTED) is S.NOT_COMMITTED


def test_a_pause_can_be_taken_back_before_it_lands() -> None:
    assert apply(RUN_TABLE, R.PAUSING, V.RESUME) is R.RUNNING


def test_a_paused_run_can_be_cancelled() -> None:
    """A pause never shields a run from a cancel (R1 holds in every state)."""
    assert apply(RUN_TABLE, R.PAUSING, V.CANCEL) is R.CANCELLING
    assert apply(RUN_TABLE, R.PAUSED, V.CANCEL) is R.CANCELLING


def test_a_cancel_with_nothing_in_flight_settles() -> None:
    """Nothing to resolve: ``settling`` is skipped."""
    assert apply(RUN_TABLE, R.CANCELLING, V.SETTLED) is R.CANCELLED


def test_a_reviewed_run_ends_cancelled() -> None:
    assert apply(RUN_TABLE, R.NEEDS_REVIEW, V.REVIEWED) is R.CANCELLED


def test_a_workflow_ending_during_a_pause_ends_it() -> None:
    """A workflow that returns while its run is pausing or paused has nothing left to pause."""
    for state in (R.PAUSING, R.PAUSED):
        assert apply(RUN_TABLE, state, V.COMPLETE) is R.COMPLETED
        assert apply(RUN_TABLE, state, V.FAIL) is R.FAILED


def test_a_running_run_with_an_unknown_escalates() -> None:
    """A run that was never cancelled still goes to review when an outcome is unknowable."""
    assert apply(RUN_TABLE, R.RUNNING, V.ESCALATE) is R.NEEDS_REVIEW


def test_r10_a_cancelled_run_resumes_from_a_checkpoint() -> None:
    """R10: the only way from ``cancelled`` back to running (the ledger checks the
    checkpoint); the other way out is to review (ADR 0093)."""
    assert events_from(RUN_TABLE, R.CANCELLED) == [V.ESCALATE, V.RESUME]
    assert apply(RUN_TABLE, R.CANCELLED, V.RESUME) is R.RUNNING


def test_a_settled_cancel_is_reopened_by_its_evidence() -> None:
    """ADR 0093: a call of a settled cancelled run (or of its tree) back in review (a
    late response contradicting it) sends the run to review; a run that ended on its
    own keeps its state (what its workflow did), its receipt saying review."""
    assert apply(RUN_TABLE, R.CANCELLED, V.ESCALATE) is R.NEEDS_REVIEW
    assert settle_move(R.CANCELLED, {S.NEEDS_REVIEW, S.COMMITTED}) == (V.ESCALATE, False)
    assert settle_move(R.CANCELLED, {S.COMMITTED}, {R.NEEDS_REVIEW}) == (V.ESCALATE, False)
    assert settle_move(R.CANCELLED, {S.COMMITTED}) == (None, False)
    assert {R.COMPLETED, R.FAILED} == FINAL_RUN_STATES


def test_diagram_is_drawn_from_the_table() -> None:
    lines = diagram(OPERATION_TABLE).splitlines()
    assert "requested --lost--> unknown" in lines
    assert "committed --compensation_started--> compensating" in lines
    assert len(lines) == len(CONTRACT_OPERATION) + sum(isinstance(k[0], OpStatus) for k in BEYOND)


@pytest.mark.parametrize(
    ("state", "statuses", "move"),
    [
        # a correction or a call still on its way: settling, nothing verified yet
        (R.CANCELLING, {S.COMMITTED, S.REQUESTED}, (V.SETTLE, False)),
        (R.SETTLING, {S.ACCEPTED}, (None, False)),
        # an unknown outcome: settling, and read back
        (R.CANCELLING, {S.UNKNOWN, S.PREVENTED}, (V.SETTLE, True)),
        (R.SETTLING, {S.UNKNOWN}, (None, True)),
        (R.SETTLING, {S.COMPENSATING}, (None, True)),
        # what only a person can settle: review, once
        (R.SETTLING, {S.NEEDS_REVIEW, S.COMMITTED}, (V.ESCALATE, False)),
        (R.NEEDS_REVIEW, {S.COMPENSATION_FAILED}, (None, False)),
        # every review item settled by later evidence
        (R.NEEDS_REVIEW, {S.NOT_COMMITTED}, (V.REVIEWED, False)),
        # everything resolved: settled (R3: never before)
        (R.CANCELLING, {S.COMMITTED, S.NOT_COMMITTED, S.PREVENTED}, (V.SETTLED, False)),
        (R.SETTLING, set(), (V.SETTLED, False)),
        # settled: only review moves it (ADR 0093)
        (R.CANCELLED, {S.COMMITTED, S.NOT_COMMITTED}, (None, False)),
        (R.CANCELLED, {S.NEEDS_REVIEW}, (V.ESCALATE, False)),
        (R.CANCELLED, {S.COMPENSATED, S.COMPENSATION_FAILED}, (V.ESCALATE, False)),
    ],
)
def test_a_cancelled_runs_next_move_follows_from_its_operations(
    state: RunState, statuses: set[OpStatus], move: tuple[RunEvent | None, bool]
) -> None:
    """The settler's one rule: what a cancelled run does next, from its calls' statuses.
    Every move it names is a legal arrow of the run table."""
    assert settle_move(state, statuses) == move
    if move[0] is not None:
        apply(RUN_TABLE, state, move[0])  # raises IllegalTransition if it were not


def test_a_settling_step_decides_from_open_statuses_alone() -> None:
    """Every run state, every set of operation statuses: ``settle_move`` answers the
    same from the open statuses alone (``ops_open``'s). So a settling step's read
    (``guards.SETTLING_SQL``) may leave a run's other settled operations out; only
    the compensation policy needs some of them, and that read keeps those."""
    from stopline.ledger.engine.guards import OPEN

    statuses = list(OpStatus)
    for state in RunState:
        for size in range(len(statuses) + 1):
            for chosen in itertools.combinations(statuses, size):
                every = set(chosen)
                assert settle_move(state, every) == settle_move(state, every & OPEN), (state, every)
