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
- **A continue-as-new's execution is its place in the chain** (ADR 0119): it goes
  on in the run the header carries, its keys naming ``FIRST~N`` (``next_in_chain``),
  not its own execution, so that a reset of an earlier execution, which continues
  as new again, reaches the operations the chain recorded at each place.
- **An activity whose workflow runs without the plugin** (``ungated``, ADR 0098):
  no run header, and no run its workflow opened: refused before dispatch, as a
  gated DBOS step of an ungated workflow is. Its calls would join a run nothing
  ends (its receipt "Running." for ever) and no workflow cancel fences.
- **An activity's run and key** (``activity_run``, ``keyed_by_header``,
  ``call_of``): read from the headers its workflow's side sets.
- **A standalone activity** (started by a client, no workflow; ADR 0103): each
  execution is a run of its own, ``ACTIVITY_ID@run:activity:ACTIVITY_RUN_ID``
  (``activity_run_id``), made by its first gated call; every attempt of the
  execution reaches its one operation, and an execution that reuses the id is
  another run. No workflow's run has that form (a workflow id holding ``@run:``
  is derived, and an execution's own run ends in Temporal's run id, which holds
  no ``:``), so a workflow named ``activity:X`` is never activity X's run, and
  a cancel of the activity's run asks Temporal to cancel the activity.
- **The workflow of a run**, for a process that opened none (``temporal.cancel``
  of a tree): a derived run id and an execution's own run are no workflow ids;
  a fenced child's workflow is found among the pending children Temporal
  records for its parent (``pending_children``, ``runs_of``).
- **Cancels from a process that runs no worker** (``cancel``, ``cancel_activity``):
  the run fenced first, then Temporal asked (``request_cancel``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Collection, Mapping

import temporalio.client
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import ExecuteActivityInput

from stopline.domain.limits import check_id, fitted
from stopline.domain.model import RunRecord
from stopline.domain.receipt import Receipt
from stopline.errors import UnknownRun
from stopline.integrations._engine_trees import Children, workflows_of
from stopline.integrations._engines import (
    ENDED_ON_ITS_OWN,
    RUN_ROOM,
    EngineGate,
    cancel_collecting,
    engine_run_id,
    find_run,
    resumed_after_cancel,
)
from stopline.integrations._temporal_workflow import EXECUTION_HEADER, LOCAL_HEADER, RUN_HEADER
from stopline.ledger.backend import RunSpec
from stopline.runtime.ledger import Ledger

__all__ = [
    "activity_run",
    "activity_run_id",
    "call_of",
    "cancel",
    "cancel_activity",
    "execution_run",
    "keyed_by_header",
    "next_in_chain",
    "own_run",
    "pending_children",
    "request_cancel",
    "run_id_of",
    "runs_of",
    "standalone_of",
    "ungated",
]

_EXECUTION = "@run:"
_ACTIVITY = "@run:activity:"
_NEXT = "~"  # ``FIRST~N``: the keys of the Nth execution after a chain's first (ADR 0119)
_EXECUTION_ROOM = 36  # an execution's in an operation's id (``_engines.RUN_ROOM``)
# what follows ``_ACTIVITY`` in a standalone activity's run: Temporal's activity run id (a
# UUID), or nothing (a server that gives none); never a ``:``, ``#`` or ``@``
_ACTIVITY_RUN = re.compile(r"[0-9A-Za-z_-]*")
# Temporal gave no answer (the service down, restarting or overloaded): nothing was decided
_UNANSWERED = frozenset(
    {RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.RESOURCE_EXHAUSTED}
)


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
        # Temporal's run id holds no ``:``: ``activity:RUN_ID`` is a standalone activity's
        if marker and head and ":" not in execution and run_id_of(workflow_id, execution) == run:
            found.append(run)
    return found


def activity_run_id(activity_id: str, activity_run: str) -> str:
    """The stopline run of a standalone activity's execution (ADR 0103): ``activity_run``
    is Temporal's run id of the execution (``ActivityHandle.run_id``,
    ``activity.info().activity_run_id``); ``ACTIVITY_ID@run:activity:ACTIVITY_RUN_ID``,
    the activity id derived as a workflow id is when it does not fit or is not printable
    (``fitted``). No workflow's run has this form."""
    head = fitted(activity_id, RUN_ROOM - len(_ACTIVITY) - len(activity_run))
    return f"{head}{_ACTIVITY}{activity_run}"


def standalone_of(run_id: str) -> tuple[str, str] | None:
    """The standalone activity (its id, its execution's run id) whose run ``run_id`` is;
    ``None`` when it is none, or its activity id was derived (not to be read back)."""
    head, marker, activity_run = run_id.rpartition(_ACTIVITY)
    if not marker or not head or not _ACTIVITY_RUN.fullmatch(activity_run):
        return None
    return (head, activity_run) if activity_run_id(head, activity_run) == run_id else None


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
    continued: str = "",
) -> tuple[str, str]:
    """The run a workflow execution opens, and the execution its activities' keys
    name: its ``original`` (the same as its own unless it is a reset) in the run that
    execution is in; its own in a run of its own; an execution a continue-as-new goes
    on in the run with, its place in the chain (``next_in_chain`` of ``continued``,
    what the keys of the execution it goes on from named: ADR 0119). A cancelled run
    is kept: its fence refuses every later execution of the id (ADR 0024) until it is
    resumed."""
    original = original or execution
    if carried:
        record = await find_run(gate.ledger, carried)
        if record is not None and record.state not in ENDED_ON_ITS_OWN:
            return carried, next_in_chain(continued) if continued else original
    run_id = run_id_of(workflow_id)
    record = await find_run(gate.ledger, run_id)
    if record is not None and record.state in ENDED_ON_ITS_OWN:
        run_id = await own_run(gate.ledger, workflow_id, execution, original)
        if run_id == run_id_of(workflow_id, execution):
            original = execution
    opened = await gate.open_run(run_id, workflow, parent_id=parent_id, shared=shared)
    gate.remember_engine_id(run_id, workflow_id)
    return run_id, await _keyed_by(gate, opened, original)


def next_in_chain(keyed_by: str) -> str:
    """What the keys of the execution a continue-as-new starts name, from what its
    predecessor's named (ADR 0119): ``FIRST~N`` for the Nth after the chain's first
    (whose keys name ``FIRST``). The same wherever the chain is re-run from: a reset
    of an earlier execution continues as new into the same names, and reaches the
    operations the chain recorded there (committed: their results, never sent again),
    as a reset execution reaches its original's (ADR 0073)."""
    head, mark, count = keyed_by.rpartition(_NEXT)
    if not (mark and head and count.isdecimal()):
        head, count = keyed_by, "0"
    after = f"{_NEXT}{int(count) + 1}"
    # within an execution's room in an operation's id (a Temporal run id's 36): the
    # start of FIRST, which only this run's other executions' keys could meet
    return f"{head[: max(1, _EXECUTION_ROOM - len(after))]}{after}"


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
    the header) its workflow id's; a standalone activity's execution (no workflow) is a
    run of its own (``activity_run_id``)."""
    payload = input.headers.get(RUN_HEADER)
    if payload is not None:
        return str(activity.payload_converter().from_payload(payload, str))
    if info.workflow_id:
        return run_id_of(info.workflow_id)
    return activity_run_id(info.activity_id, info.activity_run_id or "")


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


async def cancel(
    ledger: Ledger,
    client: temporalio.client.Client,
    workflow_id: str,
    *,
    by: str,
    reason: str = "",
    owner: str | None = None,
    tenant: str = "default",
) -> Receipt:
    """Fence the workflow's run (durably, first), then request the Temporal cancel of
    it and of the children it owns exclusively (each child's workflow found among the
    pending children Temporal records: a run id may be derived, or an execution's
    own). For a process that runs no worker. A standalone activity: ``cancel_activity``.

    The run is that of the workflow's current execution (``run_id_of``). A workflow
    Temporal holds but no worker has started yet gets its run now, fenced at once
    (its ``owner`` the canceller unless given): it does nothing when it starts.
    ``UnknownRun`` when neither the ledger nor Temporal knows the workflow.

    The workflow id's run, if the ledger has it and it has not ended, is fenced before
    Temporal is asked anything. Temporal unreachable: that done, Temporal's
    ``RPCError`` is raised: its cancel was not requested (a worker of the run asks it
    once Temporal answers)."""
    run_id = run_id_of(workflow_id)
    root = await find_run(ledger, run_id)
    described = None
    # a run the ledger has that has not ended is the one to fence: fenced before Temporal
    # is asked anything (down, its client's retries held the stop back ~10 s)
    if root is None or root.state in ENDED_ON_ITS_OWN:
        try:
            described = await client.get_workflow_handle(workflow_id).describe()
        except RPCError as exc:
            if exc.status is not RPCStatusCode.NOT_FOUND:
                raise  # unanswered: which execution's run it is, Temporal alone can say
    if described is not None and root is not None and root.state in ENDED_ON_ITS_OWN:
        original = await _original_execution(client, workflow_id, described.run_id)
        own = await own_run(ledger, workflow_id, described.run_id, original)
        queued = described.status is temporalio.client.WorkflowExecutionStatus.RUNNING
        if queued or await find_run(ledger, own) is not None:
            run_id = own

    async def unstarted() -> RunSpec | None:
        if described is None or described.status is not (
            temporalio.client.WorkflowExecutionStatus.RUNNING
        ):
            return None
        name = f"temporal:{fitted(described.workflow_type, RUN_ROOM)}"
        return RunSpec(id=run_id, name=name, owner=owner or by, tenant=tenant)

    receipt, fenced = await cancel_collecting(
        ledger, run_id, by=by, reason=reason, unstarted=unstarted
    )
    # a fenced child's workflow: among the pending children Temporal records (its run's
    # id may be derived, or an execution's own: no workflow id)
    children = pending_children(client)
    for engine_id in await workflows_of(workflow_id, run_id, fenced, children, runs_of):
        await request_cancel(client, engine_id, reason)
    return receipt


async def cancel_activity(
    ledger: Ledger,
    client: temporalio.client.Client,
    activity_id: str,
    *,
    run_id: str | None = None,
    by: str,
    reason: str = "",
    owner: str | None = None,
    tenant: str = "default",
) -> Receipt:
    """Fence a standalone activity's run (durably, first), then request the Temporal
    cancel of the activity itself (ADR 0103). For a process that runs no worker.

    The execution is ``run_id`` (Temporal's: ``ActivityHandle.run_id``), else the
    activity id's latest, which Temporal is asked for first. One Temporal holds that no
    attempt has started yet gets its run now, fenced at once (its ``owner`` the
    canceller unless given): it sends nothing when it starts. ``UnknownRun`` when
    neither the ledger nor Temporal knows it. Temporal unreachable: the run fenced
    (with ``run_id`` given), Temporal's ``RPCError`` is raised: its cancel was not
    requested (a worker of the run asks it once Temporal answers). An empty or
    overlong ``activity_id`` or ``run_id``: ``InvalidInput`` naming it, nothing asked."""
    check_id("activity_id", activity_id)  # before the ledger or Temporal is asked
    if run_id is not None:
        check_id("run_id", run_id)
    described: list[temporalio.client.ActivityExecutionDescription] = []
    if run_id is None:
        found = await _described(client, activity_id, None)
        if found is None:
            raise UnknownRun(activity_run_id(activity_id, ""))
        described.append(found)
        run_id = found.activity_run_id or ""
    run = activity_run_id(activity_id, run_id)

    async def unstarted() -> RunSpec | None:
        found = described[0] if described else await _described(client, activity_id, run_id)
        if found is None or found.status is not temporalio.client.ActivityExecutionStatus.RUNNING:
            return None
        name = f"temporal:{fitted(found.activity_type, RUN_ROOM)}"
        return RunSpec(id=run, name=name, owner=owner or by, tenant=tenant)

    receipt, _ = await cancel_collecting(ledger, run, by=by, reason=reason, unstarted=unstarted)
    await request_cancel(client, "", reason, activity=(activity_id, run_id))
    return receipt


async def _described(
    client: temporalio.client.Client, activity_id: str, run_id: str | None
) -> temporalio.client.ActivityExecutionDescription | None:
    """What Temporal says of the activity's execution (its latest without ``run_id``);
    ``None`` when it knows none. Raises its ``RPCError`` when it does not answer."""
    try:
        return await client.get_activity_handle(activity_id, run_id=run_id or None).describe()
    except RPCError as exc:
        if exc.status is not RPCStatusCode.NOT_FOUND:
            raise
        return None


async def _original_execution(
    client: temporalio.client.Client, workflow_id: str, execution: str
) -> str:
    """The execution a reset ``execution`` was reset from (ADR 0073; its own if none),
    from its history's first event; ``""`` when Temporal cannot say."""
    handle = client.get_workflow_handle(workflow_id, run_id=execution)
    try:
        async for event in handle.fetch_history_events():
            return event.workflow_execution_started_event_attributes.original_execution_run_id
    except RPCError:
        pass
    return ""


async def request_cancel(
    client: temporalio.client.Client,
    workflow_id: str,
    reason: str,
    *,
    activity: tuple[str, str] | None = None,
    until_answered: bool = False,
) -> None:
    """Ask Temporal to cancel the workflow, or with ``activity`` (its id, its execution's
    run id) that standalone activity: never a workflow in its stead (ADR 0103).
    Idempotent: one already cancelled, closed or unknown needs nothing. One Temporal did
    not answer is asked again ``until_answered`` (a worker's, in the ledger's background
    work), else raises its ``RPCError``: not requested."""
    delay = 0.1
    said = reason or "stopline cancel"
    while True:
        try:
            if activity is not None:
                handle = client.get_activity_handle(activity[0], run_id=activity[1] or None)
                return await handle.cancel(reason=said)
            return await client.get_workflow_handle(workflow_id).cancel(reason=said)
        except RPCError as exc:
            if exc.status in _UNANSWERED and not until_answered:
                raise
            if exc.status not in _UNANSWERED:
                return None
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)
