"""A workflow's run that Temporal closed and nothing ended (ADR 0119).

A workflow's run is ended by its workflow's side (``stopline.end_run``) before Temporal
records the workflow's end; when the ledger refuses that write for good (an operator's
trigger, ``LedgerRefused``: ADR 0111), the workflow fails loudly, and its run is left
"running" with nothing left to end it. The worker's look (as it starts, then at each of
its ledger's sweeps for dead workers, beside the standalone activities': ADR 0105) ends
it as Temporal recorded the workflow's end, once the ledger takes the write:

- **Completed**: the run completed. **Failed**: failed with Temporal's record of the
  workflow's failure (``TYPE: message``; for a refused end, the failure that names
  its run and says its code returned). Nothing else: a workflow still running, or
  between executions (a continue-as-new, a retry, a reset: the next one goes on in
  the run, or in one of its own), is left to its own end; a terminate, a timeout or
  a cancel is the fence's (``closed_under``, the workflow's side, ``ledger.cancel``).
- **Which execution**: a workflow id's run is that of the id's latest execution
  (every execution of the id joins it while it is not ended); an execution's own run
  (``WORKFLOW_ID@run:RUN_ID``) is that execution's, whatever came after it.
- **Left as it is**: a run whose workflow id is derived (``run_id_of`` cannot read it
  back), one Temporal no longer knows (past its retention), and one with a call in
  flight under a live worker's lease (that worker's activity is at work in it).
"""

from __future__ import annotations

from datetime import timedelta

import temporalio.client
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowHistoryEventFilterType
from temporalio.service import RPCError, RPCStatusCode

from stopline.integrations._temporal_runs import run_id_of, standalone_of

__all__ = ["workflow_end", "workflow_of"]

_EXECUTION = "@run:"
_ASK = timedelta(seconds=5)
# Temporal knows no such execution (past its retention), or the id is none of its run ids
_NOT_THERE = frozenset({RPCStatusCode.NOT_FOUND, RPCStatusCode.INVALID_ARGUMENT})


def workflow_of(run_id: str) -> tuple[str, str] | None:
    """The workflow (its id, and the execution whose own run it is, else ``""``) whose
    run ``run_id`` is; ``None`` for a standalone activity's, or a derived id."""
    if standalone_of(run_id) is not None:
        return None
    head, marker, execution = run_id.rpartition(_EXECUTION)
    if marker and head and execution and ":" not in execution:
        return (head, execution) if run_id_of(head, execution) == run_id else None
    return (run_id, "") if run_id_of(run_id) == run_id else None


async def workflow_end(
    client: temporalio.client.Client, workflow_id: str, execution: str
) -> str | None:
    """How Temporal recorded the end of the workflow's execution (``execution``, else the
    id's latest): ``""`` completed; failed, its failure as Temporal recorded it (``TYPE:
    message``); ``None`` when it has not ended so, or Temporal no longer knows it.
    Raises Temporal's ``RPCError`` when it does not answer."""
    handle = client.get_workflow_handle(workflow_id, run_id=execution or None)
    try:
        described = await handle.describe(rpc_timeout=_ASK)
        if described.status is WorkflowExecutionStatus.COMPLETED:
            return ""
        if described.status is not WorkflowExecutionStatus.FAILED:
            return None
        closed = client.get_workflow_handle(workflow_id, run_id=described.run_id)
        async for event in closed.fetch_history_events(
            event_filter_type=WorkflowHistoryEventFilterType.CLOSE_EVENT, rpc_timeout=_ASK
        ):
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED:
                failure = event.workflow_execution_failed_event_attributes.failure
                kind = failure.application_failure_info.type or "WorkflowFailure"
                return f"{kind}: {failure.message}"
    except RPCError as exc:
        if exc.status in _NOT_THERE:
            return None
        raise
    return None
