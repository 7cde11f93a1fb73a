"""DBOS: steps that touch the world pass the gate (``stopline[dbos]``).

    gate = StoplineDBOS(owner="user:42")

    @DBOS.workflow()
    @gate.workflow()
    async def publish(topic: str) -> None: ...

    @DBOS.step()
    @gate.step(description="upload the report", verify=read_back_upload)
    async def upload(payload: str) -> str: ...

    async with stopline.open(url) as ledger:
        with gate.bound(ledger):
            DBOS.launch()

``gate.workflow()`` goes inside ``@DBOS.workflow()`` and ``gate.step()``
inside ``@DBOS.step()``, so DBOS's own context (the workflow id, the step's
function id) is there when stopline's wrapper runs. Like DBOS itself, a
``StoplineDBOS`` is declared at import time and bound to a ledger at launch.
What it promises:

- **A step is an operation** ``WORKFLOW_ID/FUNCTION_ID:STEP_NAME``. DBOS runs
  a step at least once: a crash after the effect and before DBOS's checkpoint
  runs it again on recovery, and it reaches the same operation: a committed
  one returns its recorded result, one in doubt is read back first (R5), and
  none is re-sent blind. DBOS retries (``retries_allowed``) pass the gate
  again, and are refused after the fence.
- **Both cancels.** ``DBOS.cancel_workflow`` fences the run when the workflow
  next reaches DBOS's own check (before a step, through a preemptible
  step's watcher, or as a step DBOS does not preempt ends); a stopline
  cancel (API, CLI, console) cancels the DBOS workflow and the child
  workflows the run owns exclusively, never a shared one.
- **Policies.** DBOS never interrupts a running step unless it is declared
  ``preemptible``; then the step's ``policy`` decides: ``immediate`` (the
  default) cuts the call and records it ``unknown`` until evidence (R3);
  ``verify`` asks the provider to cancel and lets the call finish, its
  outcome recorded. A step whose provider may commit after the step was cut (a
  remote service) declares ``settles_within``: until then a read-back that finds
  nothing proves nothing (R13).
- **One database.** The ledger can live in the same PostgreSQL database as
  DBOS's system tables (another schema: ``?schema=stopline``).

Only ``async`` workflows and steps are supported: the ledger is asynchronous.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, ParamSpec, TypeVar

from dbos import DBOS
from dbos._context import get_local_dbos_context
from dbos._error import DBOSWorkflowCancelledError, DBOSWorkflowConflictIDError
from dbos._sys_db import WorkflowStatusString

from stopline.domain.limits import check_seconds
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import Cancellable, Policy
from stopline.errors import RunFenced
from stopline.integrations._engines import EngineGate, call_context, cancel_collecting
from stopline.ledger.backend import RunSpec
from stopline.runtime.ledger import Ledger
from stopline.runtime.tool import CancelFn, CompensateFn, Tool, Verifier

__all__ = ["StoplineDBOS", "call_context", "cancel"]

P = ParamSpec("P")
R = TypeVar("R")
AsyncFn = Callable[P, Coroutine[Any, Any, R]]
# DBOS's states of a workflow it holds and has not run to its end: its run may not exist yet
_NOT_STARTED = frozenset(
    s.value
    for s in (
        WorkflowStatusString.ENQUEUED,
        WorkflowStatusString.DELAYED,
        WorkflowStatusString.PENDING,
    )
)


async def cancel(
    ledger: Ledger,
    workflow_id: str,
    *,
    by: str,
    reason: str = "",
    owner: str | None = None,
    tenant: str = "default",
) -> Receipt:
    """Fence the workflow's run (durably, first), then cancel it in DBOS, with the
    children it owns exclusively. For a process with no bound ``StoplineDBOS``.

    A workflow DBOS holds but has not started yet (enqueued) gets its run now,
    fenced at once (its ``owner`` the canceller unless given): DBOS
    cancels it, and were it to start it would do nothing. ``UnknownRun`` when
    neither the ledger nor DBOS knows the workflow."""

    async def unstarted() -> RunSpec | None:
        status = await _outside_workflow(DBOS.get_workflow_status_async(workflow_id))
        if status is None or str(status.status) not in _NOT_STARTED:
            return None
        name = f"dbos:{status.name or 'workflow'}"
        return RunSpec(id=workflow_id, name=name, owner=owner or by, tenant=tenant)

    receipt, fenced = await cancel_collecting(
        ledger, workflow_id, by=by, reason=reason, unstarted=unstarted
    )
    for run_id in fenced:
        await _cancel_in_dbos(run_id, reason)
    return receipt


class StoplineDBOS:
    """Gated DBOS steps and workflows; bind it to a ledger with ``bound``."""

    def __init__(self, *, owner: str = "dbos", tenant: str = "default") -> None:
        self.owner = owner
        self.tenant = tenant
        self._tools: list[Tool[Any]] = []
        self._gate: EngineGate | None = None

    @contextlib.contextmanager
    def bound(self, ledger: Ledger) -> Iterator[EngineGate]:
        """Gated steps and workflows run through ``ledger`` inside this block."""
        gate = EngineGate(
            ledger, engine="dbos", owner=self.owner, tenant=self.tenant, tools=self._tools
        )
        gate.forward_cancels(_cancel_in_dbos)
        self._gate = gate
        try:
            yield gate
        finally:
            self._gate = None
            gate.close()

    @property
    def gate(self) -> EngineGate:
        if self._gate is None:
            raise RuntimeError("StoplineDBOS is not bound: use 'with gate.bound(ledger)'")
        return self._gate

    # -- declarations ---------------------------------------------------------------
    def step(
        self,
        *,
        name: str | None = None,
        description: str = "",
        effects: bool = True,
        cancellable: Cancellable = Cancellable.NEVER,
        policy: Policy = Policy.IMMEDIATE,
        verify: Verifier | None = None,
        cancel: CancelFn | None = None,
        compensate: CompensateFn | None = None,
        settles_within: float | None = None,
    ) -> Callable[[AsyncFn[P, R]], AsyncFn[P, R]]:
        """A step through the gate; ``effects=False`` marks a read (no gate record).
        ``settles_within``: seconds after its dispatch by which the step's effect has
        landed or never will (R13); ``None``: its effect ends with the step's code."""
        within = check_seconds("settles_within", settles_within)

        def wrap(fn: AsyncFn[P, R]) -> AsyncFn[P, R]:
            _require_async(fn)
            declared: Tool[R] = Tool(
                fn,
                name=name,
                description=description,
                effects=effects,
                cancellable=cancellable,
                settles_within=within,
            )
            declared.verify_fn, declared.compensate_fn = verify, compensate
            if cancel is not None:
                declared.canceller(cancel)
            self._tools.append(declared)
            if not effects:
                return fn

            @functools.wraps(fn)
            async def gated(*args: P.args, **kwargs: P.kwargs) -> R:
                run_id, step_id = DBOS.workflow_id, DBOS.step_id
                if run_id is None or step_id is None:
                    return await fn(*args, **kwargs)  # called outside a workflow: not a step
                gate = self.gate
                try:
                    return await gate.call(
                        run_id,
                        "workflow",  # the run exists already: its workflow opened it
                        f"{step_id}:{declared.name}",
                        gate.tool(declared.name),
                        lambda: fn(*args, **kwargs),
                        [list(args), kwargs],
                        policy=policy,
                    )
                except RunFenced as exc:  # refused at the gate: DBOS stops the workflow
                    await _cancel_in_dbos(run_id, str(exc))
                    raise DBOSWorkflowCancelledError(str(exc)) from None

            return gated

        return wrap

    def workflow(self, *, shared: bool = False) -> Callable[[AsyncFn[P, R]], AsyncFn[P, R]]:
        """The workflow's run: a child workflow's run is owned by its parent's,
        exclusively unless ``shared`` (then it goes on while another owner remains)."""

        def wrap(fn: AsyncFn[P, R]) -> AsyncFn[P, R]:
            _require_async(fn)

            @functools.wraps(fn)
            async def run(*args: P.args, **kwargs: P.kwargs) -> R:
                run_id = DBOS.workflow_id
                if run_id is None:
                    return await fn(*args, **kwargs)
                gate = self.gate
                await gate.open_run(run_id, fn.__name__, parent_id=_parent_id(), shared=shared)
                try:
                    result = await fn(*args, **kwargs)
                except DBOSWorkflowCancelledError:  # DBOS.cancel_workflow, seen at a step
                    await gate.fence(run_id, "DBOS.cancel_workflow")
                    raise
                except DBOSWorkflowConflictIDError:
                    # this execution lost the workflow: DBOS.cancel_workflow during a step
                    # it does not preempt (seen when the step's result is written), or a
                    # hand-off (resume, recovery) whose new owner goes on with the run
                    if await _cancelled_in_dbos(run_id):
                        await gate.fence(run_id, "DBOS.cancel_workflow")
                    raise
                except Exception as exc:
                    await gate.end_run(run_id, exc)
                    raise
                await gate.end_run(run_id)
                return result

            return run

        return wrap


async def _cancel_in_dbos(workflow_id: str, reason: str) -> None:
    """DBOS cancels only the workflow named: its children go by stopline's ownership."""
    await _outside_workflow(DBOS.cancel_workflow_async(workflow_id))


async def _cancelled_in_dbos(workflow_id: str) -> bool:
    status = await _outside_workflow(DBOS.get_workflow_status_async(workflow_id))
    return status is not None and str(status.status) == WorkflowStatusString.CANCELLED.value


async def _outside_workflow(call: Coroutine[Any, Any, R]) -> R:
    """Run a DBOS call as the application, not as a step of the workflow whose code
    (or whose ledger task) happens to be the caller: DBOS records calls made inside a
    workflow as its steps, and a cancel recorded so would cancel the caller."""
    return await asyncio.create_task(call, context=contextvars.Context())


def _require_async(fn: Callable[..., Any]) -> None:
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"{fn!r}: stopline gates async DBOS workflows and steps only")


def _parent_id() -> str | None:
    ctx = get_local_dbos_context()
    return (ctx.parent_workflow_id or None) if ctx is not None else None
