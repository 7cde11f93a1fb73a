"""The explorer over the demo workflow and over a handoff / approval / compensation one."""

from __future__ import annotations

import pytest

from stopline.testing.actions import DEFAULT_ACTIONS, PauseResume
from stopline.testing.explorer import explore
from stopline.testing.matrix import CellStatus, Matrix
from stopline.testing.mutations import gate_ignores_fence, receipt_overclaims
from tests.testing.workflows import Delegated, Demo, handoff_approve_reserve, report_upload_notify

ACTIONS = DEFAULT_ACTIONS


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def demo_matrix() -> Matrix:
    return await explore(report_upload_notify, Demo, actions=ACTIONS, out=None)


async def test_demo_workflow_every_supported_cell_passes(demo_matrix: Matrix) -> None:
    assert demo_matrix.ok, demo_matrix.report()
    assert demo_matrix.points == (
        "report_ready",
        "before_dispatch/upload",
        "after_gate/upload",
        "received/upload",
        "accepted/upload",
        "committed/upload",
        "responding/upload",
        "response_delivered/upload",
        "before_dispatch/notify",
        "after_gate/notify",
        "received/notify",
        "accepted/notify",
        "committed/notify",
        "responding/notify",
        "response_delivered/notify",
    )
    passed = demo_matrix.with_status(CellStatus.PASS)
    assert {c.action for c in passed} >= {"cancel", "cancel_twice", "late_response", "crash"}
    # the headlines are the ones the contract expects at each point
    assert (
        demo_matrix.cell("before_dispatch/upload", "cancel").headline.value  # type: ignore[union-attr]
        == "canceled_before_external_action"
    )
    assert (
        demo_matrix.cell("committed/notify", "cancel").headline.value  # type: ignore[union-attr]
        == "stopped_with_completed_actions"
    )


async def test_cells_that_mean_nothing_are_not_applicable(demo_matrix: Matrix) -> None:
    assert demo_matrix.cell("report_ready", "drop_connection").status is CellStatus.NOT_APPLICABLE
    assert (
        demo_matrix.cell("responding/upload", "drop_connection").status is CellStatus.NOT_APPLICABLE
    )
    # notify can never cancel: there is nothing for it to refuse
    assert demo_matrix.cell("received/notify", "refuse_cancel").status is CellStatus.NOT_APPLICABLE
    assert demo_matrix.cell("received/upload", "refuse_cancel").status is CellStatus.PASS


async def test_a_cell_reruns_alone_with_the_same_run_id(demo_matrix: Matrix) -> None:
    full = demo_matrix.cell("accepted/upload", "cancel")
    alone = await explore(report_upload_notify, Demo, only=full.id, actions=ACTIONS, out=None)
    assert len(alone) == 1
    (cell,) = alone
    assert (cell.id, cell.run_id, cell.status, cell.headline) == (
        full.id,
        full.run_id,
        full.status,
        full.headline,
    )


async def test_handoff_approval_and_compensable_tool_every_cell_passes() -> None:
    matrix = await explore(handoff_approve_reserve, Delegated, actions=ACTIONS, out=None)
    assert matrix.ok, matrix.report()
    assert "approval_requested" in matrix.points
    assert "accepted/draft" in matrix.points
    # the handoff's second sub-step is never dispatched after a cancel during the first
    assert matrix.cell("accepted/research", "cancel").status is CellStatus.PASS
    assert matrix.cell("accepted/draft", "refuse_cancel").status is CellStatus.PASS
    compensated = matrix.cell("response_delivered/reserve", "compensate")
    assert compensated.status is CellStatus.PASS


async def test_mutation_gate_ignoring_the_fence_breaks_r1_in_the_right_cells() -> None:
    cancels = (
        "cancel",
        "cancel_twice",
        "late_response",
        "cancel_resume",
        "compensate",
        "compensate_again",
    )
    with gate_ignores_fence():
        matrix = await explore(report_upload_notify, Demo, actions=ACTIONS, out=None)
    broken = {(c.point, c.action) for c in matrix.broken("R1")}
    # only where the workflow still reaches a gate after the cancel: held right before it
    expected = {
        (point, action)
        for point in ("before_dispatch/upload", "before_dispatch/notify")
        for action in cancels
    }
    assert broken == expected, matrix.report()
    assert all(c.run_id in c.text() for c in matrix.broken("R1"))


async def test_mutation_overclaiming_receipt_breaks_r8_in_the_right_cells(
    demo_matrix: Matrix,
) -> None:
    with receipt_overclaims():
        matrix = await explore(report_upload_notify, Demo, actions=ACTIONS, out=None)
    broken = {c.id for c in matrix.broken("R8")}
    honest = {
        c.id
        for c in demo_matrix
        if c.headline is not None and c.headline.value != "canceled_before_external_action"
    }
    assert broken == honest, matrix.report()
    assert not [c for c in matrix if c.status is CellStatus.FAIL and c.id not in honest]


async def test_pause_resume_during_the_last_step_settles() -> None:
    """Found by the explorer: a workflow ending while its run pauses must still complete."""
    matrix = await explore(
        report_upload_notify,
        Demo,
        actions=[PauseResume()],
        only="point=accepted/notify action=pause_resume seed=0",
        out=None,
    )
    assert matrix.ok, matrix.report()


async def _play_alone(only: str) -> tuple[Demo, Demo, str]:
    """Play one cell; the discovery run's providers, the cell's own, and the cell's run id."""
    made: list[Demo] = []

    def recording() -> Demo:
        made.append(Demo())
        return made[-1]

    matrix = await explore(report_upload_notify, recording, actions=ACTIONS, only=only, out=None)
    assert matrix.ok, matrix.report()
    (played,) = matrix
    discovery, cell = made
    return discovery, cell, played.run_id


async def test_drop_connection_drops_the_cells_own_provider() -> None:
    discovery, cell, run_id = await _play_alone(
        "point=accepted/upload action=drop_connection seed=0"
    )
    assert [k.partition("/")[0] for k in cell.upload.dropped] == [run_id]
    assert discovery.upload.dropped == []


async def test_refuse_cancel_refuses_in_the_cells_own_provider() -> None:
    discovery, cell, run_id = await _play_alone("point=received/upload action=refuse_cancel seed=0")
    assert [k.partition("/")[0] for k in cell.upload.refused] == [run_id]
    assert cell.upload.refused == cell.upload.cancel_requests
    assert discovery.upload.cancel_requests == []


async def test_a_cell_timeout_that_is_no_wait_is_refused_before_any_cell_runs() -> None:
    """A NaN ``cell_timeout`` was anyio's bare ``ValueError`` from the first cell's deadline."""
    from stopline import InvalidInput

    with pytest.raises(InvalidInput, match="cell_timeout"):
        await explore(
            report_upload_notify, Demo, actions=ACTIONS, out=None, cell_timeout=float("nan")
        )
