"""Every (state, event) pair of both tables: legal moves land, the rest raise."""

from __future__ import annotations

import itertools

import pytest

from stopline.domain.transitions import OPERATION_TABLE, RUN_TABLE, apply, diagram, events_from
from stopline.domain.vocab import OpEvent, OpStatus, RunEvent, RunState
from stopline.errors import IllegalTransition


@pytest.mark.parametrize(("state", "event"), list(itertools.product(OpStatus, OpEvent)))
def test_operation_table_every_pair(state: OpStatus, event: OpEvent) -> None:
    if (state, event) in OPERATION_TABLE:
        assert apply(OPERATION_TABLE, state, event) is OPERATION_TABLE[(state, event)]
    else:
        with pytest.raises(IllegalTransition) as info:
            apply(OPERATION_TABLE, state, event)
        assert info.value.state is state
        assert info.value.event is event
        assert state.value in str(info.value)
        assert event.value in str(info.value)


@pytest.mark.parametrize(("state", "event"), list(itertools.product(RunState, RunEvent)))
def test_run_table_every_pair(state: RunState, event: RunEvent) -> None:
    if (state, event) in RUN_TABLE:
        assert apply(RUN_TABLE, state, event) is RUN_TABLE[(state, event)]
    else:
        with pytest.raises(IllegalTransition):
            apply(RUN_TABLE, state, event)


def test_contract_diagram_edges_are_in_the_table() -> None:
    """The arrows of CONTRACT.md's operation diagram, each one a table entry."""
    edges = [
        (OpStatus.NOT_STARTED, OpEvent.GATE_PASSED, OpStatus.REQUESTED),
        (OpStatus.NOT_STARTED, OpEvent.GATE_REFUSED, OpStatus.PREVENTED),
        (OpStatus.REQUESTED, OpEvent.ACCEPTED, OpStatus.ACCEPTED),
        (OpStatus.ACCEPTED, OpEvent.COMMITTED, OpStatus.COMMITTED),
        (OpStatus.REQUESTED, OpEvent.LOST, OpStatus.UNKNOWN),
        (OpStatus.REQUESTED, OpEvent.REJECTED, OpStatus.NOT_COMMITTED),
        (OpStatus.ACCEPTED, OpEvent.CANCEL_CONFIRMED, OpStatus.NOT_COMMITTED),
        (OpStatus.UNKNOWN, OpEvent.VERIFIED_COMMITTED, OpStatus.COMMITTED),
        (OpStatus.UNKNOWN, OpEvent.VERIFIED_NOT_COMMITTED, OpStatus.NOT_COMMITTED),
        (OpStatus.UNKNOWN, OpEvent.ESCALATED, OpStatus.NEEDS_REVIEW),
        (OpStatus.COMMITTED, OpEvent.COMPENSATION_STARTED, OpStatus.COMPENSATING),
        (OpStatus.COMPENSATING, OpEvent.COMPENSATED, OpStatus.COMPENSATED),
        (OpStatus.COMPENSATING, OpEvent.COMPENSATION_FAILED, OpStatus.COMPENSATION_FAILED),
        (OpStatus.COMPENSATION_FAILED, OpEvent.ESCALATED, OpStatus.NEEDS_REVIEW),
    ]
    for source, event, target in edges:
        assert OPERATION_TABLE[(source, event)] is target


def test_prevented_passes_again_only_through_the_gate() -> None:
    """A prevented operation moves only when a resumed run dispatches it again (R10)."""
    assert events_from(OPERATION_TABLE, OpStatus.PREVENTED) == [OpEvent.GATE_PASSED]
    assert events_from(RUN_TABLE, RunState.CANCELLED) == [RunEvent.RESUME]


def test_diagram_is_drawn_from_the_table() -> None:
    text = diagram(OPERATION_TABLE)
    assert len(text.splitlines()) == len(OPERATION_TABLE)
    assert "requested --lost--> unknown" in text
