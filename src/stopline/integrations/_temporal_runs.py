"""Which stopline run a Temporal workflow execution is in, and which execution its
activities' keys name (ADRs 0050, 0056, 0073).

- **The run**: the run a continue-as-new goes on with; else the workflow id's
  run unless it ended on its own (completed, failed), which nothing reopens:
  then a run of the execution's own, ``WORKFLOW_ID@run:RUN_ID``.
- **A reset execution is the execution it was reset from** (ADR 0073):
  Temporal's reset closes an execution and runs the workflow's code again in a
  new one, from a point before which its history is kept; the new execution's
  ``original_execution_run_id`` names the first execution of that history. Its
  keys name that execution, so an activity it runs again reaches the operation
  already recorded (committed: its recorded result, never sent again), and it
  goes on in that execution's run while the run has not ended.
- **An activity whose workflow runs without the plugin** (``ungated``, ADR 0098):
  no run header, and no run its workflow opened: refused before dispatch, as a
  gated DBOS step of an ungated workflow is. Its calls would join a run nothing
  ends (its receipt "Running." for ever) and no workflow cancel fences.
- **An activity's run and key** (``activity_run``, ``keyed_by_header``,
  ``call_of``): read from the headers its workflow's side sets; a standalone
  activity (started by a client, no workflow) is a run of its own,
  ``activity:ACTIVITY_ID``, made by its first gated call.
- **The workflow of a run**, for a process that opened none (``temporal.cancel``
  of a tree): a derived run id and an execution's own run are no workflow ids;
  a fenced child's workflow is found among the pending children Temporal
  records for its parent (``pending_children``, ``runs_of``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import temporalio.client
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import ExecuteActivityInput

from stopline.domain.limits import fitted
from stopline.domain.model import RunRecord
from stopline.integrations._engine_trees import Children
from stopline.integrations._engines import (
    ENDED_ON_ITS_OWN,
    RUN_ROOM,
    EngineGate,
    engine_run_id,
    find_run,
    resumed_after_cancel,
)
from stopline.integrations._temporal_workflow import EXECUTION_HEADER, LOCAL_HEADER, RUN_HEADER
from stopline.runtime.ledger import Ledger

__all__ = [
    "activity_run",
    "call_of",
    "execution_run",
    "keyed_by_header",
    "own_run",
    "pending_children",
    "run_id_of",
    "runs_of",
    "ungated",
]

_EXECUTION = "@run:"


def run_id_of(workflow_id: str, execution: str = "") -> str:
    """The stopline run of a workflow id (ADRs 0050, 0085): the id itself when it fits
    and is printable, else its start and a digest (``engine_run_id``); with ``execution`` (a
    Temporal run id), the run of that execution of its own, ``WORKFLOW_ID@run:RUN_ID``,
    which an execution gets when the workflow id's run had ended on its own."""
    if not execution:
        return engine_run_id(workflow_id)
    head = fitted(workflow_id, RUN_ROOM - len(_EXECUTION) - len(execution))
    return f"{head}{_EXECUTION}{execution}"


def runs_of(workflow_id: str, runs: Collection[str]) -> list[str]:
    """Those of ``runs`` that are runs of ``workflow_id``: its id's, and those of its
    executions' own (``WORKFLOW_ID@run:RUN_ID``), whichever the execution (a reset's
    original, a continue-as-new's first)."""
    found = [run for run in (run_id_of(workflow_id),) if run in runs]
    for run in runs:
        head, marker, execution = run.rpartition(_EXECUTION)
        if marker and head and run_id_of(workflow_id, execution) == run:
            found.append(run)
    return found


def pending_children(client: temporalio.client.Client) -> Children:
    """The child workflows still running of each workflow (its current execution), as
    Temporal records them (``pending_children``); one Temporal no longer knows has none.
    Raises Temporal's ``RPCError`` when it does not answer."""

    async def children(parents: list[str]) -> list[str]:
        found: list[str] = []
        for parent in parents:
            try:
                described = await client.get_workflow_handle(parent).describe()
            except RPCError as exc:
                if exc.status is not RPCStatusCode.NOT_FOUND:
                    raise
                continue
            found.extend(c.workflow_id for c in described.raw_description.pending_children)
        return found

    return children


async def own_run(ledger: Ledger, workflow_id: str, execution: str, original: str) -> str:
    """The run of an execution whose workflow id's run ended on its own: the run of
    its ``original`` execution (a reset, ADR 0073) while that run has not ended, else
    one of its own."""
    if original and original != execution:
        record = await find_run(ledger, run_id_of(workflow_id, original))
        if record is not None and record.state not in ENDED_ON_ITS_OWN:
            return record.id
    return run_id_of(workflow_id, execution)


async def execution_run(
    gate: EngineGate,
    workflow_id: str,
    execution: str,
    workflow: str,
    *,
    parent_id: str | None = None,
    shared: bool = False,
    carried: str = "",
    original: str = "",
) -> tuple[str, str]:
    """The run a workflow execution opens, and the execution its activities' keys
    name: its ``original`` (the same as its own unless it is a reset) in the run that
    execution is in; its own in a run of its own. A cancelled run is kept: its fence
    refuses every later execution of the id (ADR 0024) until it is resumed."""
    original = original or execution
    if carried:
        record = await find_run(gate.ledger, carried)
        if record is not None and record.state not in ENDED_ON_ITS_OWN:
            return carried, original
    run_id = run_id_of(workflow_id)
    record = await find_run(gate.ledger, run_id)
    if record is not None and record.state in ENDED_ON_ITS_OWN:
        run_id = await own_run(gate.ledger, workflow_id, execution, original)
        if run_id == run_id_of(workflow_id, execution):
            original = execution
    opened = await gate.open_run(run_id, workflow, parent_id=parent_id, shared=shared)
    gate.remember_engine_id(run_id, workflow_id)
    return run_id, await _keyed_by(gate, opened, original)


async def _keyed_by(gate: EngineGate, run: RunRecord, execution: str) -> str:
    """The execution an execution's activity keys name (ADR 0056): ``execution``,
    except when it re-enters a run resumed after a cancel: then that of the run's
    latest operation, so that the re-entry reaches the operations of the execution
    that was cancelled (a completed one returned from the ledger, one that never
    happened sent), as the receipt's recovery line says."""
    run = await gate.ledger.backend.get_run(run.id)  # a process's copy may predate the resume
    if not resumed_after_cancel(run):
        return execution
    prefix = f"{run.id}/"
    ops = [
        op
        for op in await gate.ledger.backend.operations(run.id)
        if op.compensates is None and op.id.startswith(prefix) and ":" in op.id[len(prefix) :]
    ]
    if not ops:
        return execution
    latest = max(ops, key=lambda op: op.created_at)
    return latest.id[len(prefix) :].split(":", 1)[0]


async def ungated(
    ledger: Ledger, headers: Mapping[str, Payload], info: activity.Info, run_id: str
) -> str | None:
    """Why an activity with effects is refused before dispatch, if it is: its workflow
    runs on a worker without the plugin (its activities carry no run header, and no
    ``open_run`` of it made ``run_id``). A workflow started before the header, on a
    worker with the plugin, opened its run: it goes on. A standalone activity (no
    workflow) is a run of its own, as ever (ADR 0098)."""
    if RUN_HEADER in headers or not info.workflow_id:
        return None
    if await find_run(ledger, run_id) is not None:
        return None
    return (
        f"activity {info.activity_type!r} has effects, and its workflow "
        f"{info.workflow_id!r} ({info.workflow_type}) runs without stopline's plugin: no "
        "run was opened for it, so its calls would join a run nothing ends or fences. "
        "Give the workflow's worker the StoplinePlugin too (ADR 0098)"
    )


def activity_run(input: ExecuteActivityInput, info: activity.Info) -> str:
    """The activity's run: its workflow's (the header), else (a workflow started before
    the header) its workflow id's; a standalone activity (no workflow) is a run of its own."""
    payload = input.headers.get(RUN_HEADER)
    if payload is not None:
        return str(activity.payload_converter().from_payload(payload, str))
    if info.workflow_id:
        return run_id_of(info.workflow_id)
    return run_id_of(f"activity:{info.activity_id}")


def keyed_by_header(input: ExecuteActivityInput, info: activity.Info) -> str:
    """The execution the activity's key names: its workflow's answer from ``open_run``
    (the header), else (a workflow started before the header) its own."""
    payload = input.headers.get(EXECUTION_HEADER)
    if payload is not None:
        return str(activity.payload_converter().from_payload(payload, str))
    return info.workflow_run_id or ""


def call_of(input: ExecuteActivityInput, info: activity.Info) -> str:
    """What names the activity's call across its attempts: its activity id, else (a local
    activity, whose retry after a backoff has a new id) its call in the execution."""
    payload = input.headers.get(LOCAL_HEADER)
    if payload is None:
        return info.activity_id
    return str(activity.payload_converter().from_payload(payload, str))
