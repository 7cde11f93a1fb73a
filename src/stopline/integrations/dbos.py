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
  none is re-sent blind (one "not yet" waits for its horizon, ``_engine_doubt``;
  one still in flight, in an execution DBOS resumed or recovered the workflow
  beside, waits for that call's answer, ADR 0102). DBOS retries
  (``retries_allowed``) pass the gate again, and are refused after the fence. A
  gated step in a workflow that is not gated is refused.
- **Both cancels.** ``DBOS.cancel_workflow`` fences the run when the workflow
  next reaches DBOS's own check (before a step, through a preemptible
  step's watcher, or as a step DBOS does not preempt ends), or, while it
  waits (a child's result, ``recv``), within a second through stopline's
  watcher of the process's gated workflows (ADR 0104); a stopline
  cancel (API, CLI, console) cancels the DBOS workflow and the child
  workflows the run owns exclusively, never a shared one.
- **Whose code.** Only a step's call runs in DBOS's context: the gate and what the
  ledger starts (a read-back, a provider's cancel) run as the application. A
  ``DBOSWorkflowCancelledError`` the workflow's code or a step's call raised itself
  (DBOS's record: not cancelled) fails the run, and the workflow ends ``ERROR`` in
  DBOS with ``RunEnded`` (ADRs 0106, 0114).
- **Forks and rewinds.** A fork (``DBOS.fork_workflow``) does not send again a
  step its original did whose result DBOS never recorded (it returns the
  original's); a rewind (``DBOS.rewind_workflow``) of a workflow whose run
  ended on its own raises ``RunEnded`` and is not cancelled in DBOS (ADR 0072).
- **Policies.** DBOS never interrupts a running step unless it is declared
  ``preemptible`` (or DBOS cuts it at its ``timeout_seconds``, recorded as that
  cut, not as a cancel); then the step's ``policy`` decides: ``immediate`` (the
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

import contextlib
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, ParamSpec, TypeVar

from dbos import DBOS
from dbos._context import get_local_dbos_context
from dbos._error import DBOSWorkflowCancelledError
from dbos._sys_db import WorkflowStatusString

from stopline.domain.guidance import OnResume, on_resume
from stopline.domain.limits import check_seconds
from stopline.domain.model import RunRecord
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import Cancellable, Cause, Policy
from stopline.errors import (
    InvalidInput,
    NoAnswer,
    NotReplayable,
    OperationInDoubt,
    RunEnded,
    RunFenced,
    UnknownOperation,
    describe,
)
from stopline.integrations._dbos_context import (
    as_application,
    cancelled_in_dbos,
    owner_token,
    step_body,
    workflow_raised,
)
from stopline.integrations._dbos_watch import Watcher, short
from stopline.integrations._dbos_watch import outside_workflow as _outside_workflow
from stopline.integrations._engine_doubt import decided_at, until_decidable
from stopline.integrations._engine_trees import workflows_of
from stopline.integrations._engines import (
    ENDED_ON_ITS_OWN,
    EngineGate,
    call_context,
    cancel_collecting,
    engine_key,
    engine_run_id,
    find_run,
)
from stopline.ledger.backend import RunSpec
from stopline.runtime.ledger import Ledger
from stopline.runtime.tool import CancelFn, CompensateFn, Tool, Verifier

__all__ = ["StoplineDBOS", "call_context", "cancel", "run_id_of"]

log = logging.getLogger("stopline.integrations.dbos")
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


def run_id_of(workflow_id: str) -> str:
    """The stopline run of a DBOS workflow id: the id itself when it has at most 890
    characters and no control character (the usual case), else its printable start and
    a digest, ``HEAD#sha256:HEX`` (ADR 0085): ``stopline show`` takes it."""
    return engine_run_id(workflow_id)


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
    run_id = run_id_of(workflow_id)

    async def unstarted() -> RunSpec | None:
        status = await _outside_workflow(DBOS.get_workflow_status_async(workflow_id))
        if status is None or str(status.status) not in _NOT_STARTED:
            return None
        name = f"dbos:{status.name or 'workflow'}"
        return RunSpec(id=run_id, name=name, owner=owner or by, tenant=tenant)

    receipt, fenced = await cancel_collecting(
        ledger, run_id, by=by, reason=reason, unstarted=unstarted
    )
    for workflow in await workflows_of(workflow_id, run_id, fenced, _children):
        await _cancel_in_dbos(workflow, reason)
    return receipt


async def _children(parents: list[str]) -> list[str]:
    """The DBOS workflows these workflows started: DBOS's parent links."""
    found = await _outside_workflow(DBOS.list_workflows_async(parent_workflow_id=parents))
    return [child.workflow_id for child in found]


class StoplineDBOS:
    """Gated DBOS steps and workflows; bind it to a ledger with ``bound``."""

    def __init__(self, *, owner: str = "dbos", tenant: str = "default") -> None:
        self.owner = owner
        self.tenant = tenant
        self._tools: list[Tool[Any]] = []
        self._gate: EngineGate | None = None
        self._watcher: Watcher | None = None  # DBOS's cancels of waiting workflows
        # the workflow each running fork was forked from (None: not a fork), read once
        self._origins: dict[str, str | None] = {}

    @contextlib.contextmanager
    def bound(self, ledger: Ledger) -> Iterator[EngineGate]:
        """Gated steps and workflows run through ``ledger`` inside this block."""
        gate = EngineGate(
            ledger, engine="dbos", owner=self.owner, tenant=self.tenant, tools=self._tools
        )
        gate.forward_cancels(_cancel_in_dbos)
        self._gate, self._watcher = gate, Watcher(gate)
        try:
            yield gate
        finally:
            self._gate = self._watcher = None
            gate.close()

    @property
    def gate(self) -> EngineGate:
        if self._gate is None:
            raise RuntimeError("StoplineDBOS is not bound: use 'with gate.bound(ledger)'")
        return self._gate

    @property
    def _watch(self) -> Watcher:
        if self._watcher is None:
            raise RuntimeError("StoplineDBOS is not bound: use 'with gate.bound(ledger)'")
        return self._watcher

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
                workflow_id, step_id = DBOS.workflow_id, DBOS.step_id
                if workflow_id is None or step_id is None:
                    return await fn(*args, **kwargs)  # called outside a workflow: not a step
                if not _GATED.get(workflow_id):  # its run would be opened, and never end
                    raise InvalidInput("DBOS workflow", _not_gated(workflow_id, declared.name))
                body = step_body(fn, args, kwargs)  # only the call runs as the step
                with as_application():  # the gate, and what it starts, do not (ADR 0106)
                    call = (body, [list(args), kwargs])
                    return await self._gated(workflow_id, step_id, declared, policy, call)

            return gated

        return wrap

    def workflow(self, *, shared: bool = False) -> Callable[[AsyncFn[P, R]], AsyncFn[P, R]]:
        """The workflow's run: a child workflow's run is owned by its parent's,
        exclusively unless ``shared`` (then it goes on while another owner remains)."""

        def wrap(fn: AsyncFn[P, R]) -> AsyncFn[P, R]:
            _require_async(fn)

            @functools.wraps(fn)
            async def run(*args: P.args, **kwargs: P.kwargs) -> R:
                workflow_id = DBOS.workflow_id
                if workflow_id is None:
                    return await fn(*args, **kwargs)
                gate, run_id = self.gate, run_id_of(workflow_id)
                parent, deadline = _parent_id(), _deadline()  # from DBOS's context
                execution = deadline, owner_token()
                with as_application():  # the ledger's work is not the workflow's (ADR 0106)
                    await gate.open_run(run_id, fn.__name__, parent_id=parent, shared=shared)
                gate.remember_engine_id(run_id, workflow_id)
                _GATED[workflow_id] = _GATED.get(workflow_id, 0) + 1
                watcher = self._watch
                watcher.add(workflow_id, run_id, deadline)
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as exc:  # a cancel, a lost workflow, an error
                    with as_application():
                        instead = await workflow_raised(gate, workflow_id, run_id, execution, exc)
                    if instead is not None:  # DBOS records it, not DBOS's cancel (ADR 0114)
                        raise instead from exc
                    raise
                finally:
                    watcher.remove(workflow_id)
                    self._origins.pop(workflow_id, None)
                    if _GATED[workflow_id] > 1:
                        _GATED[workflow_id] -= 1
                    else:
                        del _GATED[workflow_id]
                with as_application():
                    await gate.end_run(run_id)
                return result

            return run

        return wrap

    async def _gated(
        self,
        workflow_id: str,
        step_id: int,
        declared: Tool[R],
        policy: Policy,
        call: tuple[Callable[[], Awaitable[R]], list[Any]],
    ) -> R:
        """The step's ``call`` (its body and its arguments) through the gate."""
        run_id = run_id_of(workflow_id)
        gate, key = self.gate, f"{step_id}:{engine_key(declared.name)}"
        done, result = await self._done_before_the_fork(workflow_id, step_id, key)
        if done:
            return result  # type: ignore[no-any-return]
        body, args = call
        tool = gate.tool(declared.name)
        cut = functools.partial(_why_cut, workflow_id)
        try:
            with self._watch.in_step(workflow_id):
                while True:
                    try:  # the run exists already: its workflow opened it
                        return await gate.call(
                            run_id, "workflow", key, tool, body, args, policy=policy, cut=cut
                        )
                    except OperationInDoubt as exc:  # a later look may decide it
                        await _until_decidable(gate, run_id, workflow_id, key, exc)
        except RunFenced:  # refused at the gate: DBOS stops the workflow
            run = await find_run(gate.ledger, run_id)
            if run is not None and run.state in ENDED_ON_ITS_OWN:
                # DBOS.rewind_workflow of a finished workflow: nobody cancelled it
                raise RunEnded(run_id, run.state, _REWOUND) from None
            why = _still_cancelled(workflow_id, key, run)
            log.warning("%s", why)
            await _cancel_in_dbos(workflow_id, why)
            raise DBOSWorkflowCancelledError(why) from None

    async def _done_before_the_fork(
        self, workflow_id: str, step_id: int, key: str
    ) -> tuple[bool, Any]:
        """In a fork (``DBOS.fork_workflow``), a step its original ran whose result DBOS
        did not record (a cancel took the workflow before the step's checkpoint): DBOS
        runs it again in the fork, under the fork's id, though the original's operation
        says it happened. Its recorded result is returned instead (nothing is sent); one
        in doubt raises ``OperationInDoubt`` (settle the original's first). A step DBOS
        recorded in the original runs in the fork only when the fork starts at or before
        it: asked for, it is the fork's own (ADR 0072)."""
        if workflow_id not in self._origins:
            status = await _outside_workflow(DBOS.get_workflow_status_async(workflow_id))
            if len(self._origins) >= _REMEMBER_ORIGINS:  # steps of ungated workflows
                del self._origins[next(iter(self._origins))]
            self._origins[workflow_id] = status.forked_from if status is not None else None
        origin = self._origins[workflow_id]
        if origin is None:
            return False, None
        try:
            op = await self.gate.ledger.backend.get_operation(f"{run_id_of(origin)}/{key}")
        except UnknownOperation:
            return False, None
        then = on_resume(op.status)
        if then is OnResume.SENT:
            return False, None  # it never happened: the fork sends its own
        steps = await _outside_workflow(DBOS.list_workflow_steps_async(origin))
        if any(s["function_id"] == step_id for s in steps):
            return False, None  # DBOS recorded it: the fork was asked to run it again
        if then is OnResume.REPLAYED:
            if op.result_not_kept is not None:
                raise NotReplayable(op.id, op.result_not_kept)
            return True, op.result
        raise OperationInDoubt(op.id, op.status)


async def _until_decidable(
    gate: EngineGate, run_id: str, workflow_id: str, key: str, exc: OperationInDoubt
) -> None:
    """Wait in place until a look at the operation in doubt can decide it; ``exc`` when
    none can (no read-back: review). "Not yet" (R13): until its horizon. In flight
    (``requested``, ``accepted``): until its attempt's outcome is recorded. That attempt
    is another execution's of this workflow, still at work (DBOS resumed or recovered
    the workflow while a step it does not preempt ran), or a worker's whose death the
    ledger has not seen yet: sent again it would be a second effect, and raised it
    failed the workflow whose step may have succeeded (ADR 0102). A cancel ends the
    wait: stopline's as its gate refuses (``RunFenced``), DBOS's as DBOS's check does.
    The wait is the engines' one (``until_decidable``: Temporal's retries wait so too)."""

    async def dbos_check() -> None:  # DBOS's own check, after each wait
        if await cancelled_in_dbos(workflow_id):
            waited = f"{workflow_id} cancelled while {key!r} waited"
            raise DBOSWorkflowCancelledError(waited) from exc

    await until_decidable(gate, run_id, exc, await decided_at(gate.ledger, exc), look=dbos_check)


_REMEMBER_ORIGINS = 10_000
# the DBOS workflows whose gated code runs in this process now (any ``StoplineDBOS``'s),
# by how many executions of each: a gated step runs only inside one
_GATED: dict[str, int] = {}


def _not_gated(workflow_id: str, step: str) -> str:
    return (
        f"{workflow_id!r} runs the gated step {step!r} but is not gated itself: its run"
        " would be opened by the step and never end. Put @gate.workflow() inside its"
        " @DBOS.workflow(); nothing was sent"
    )


# what a rewound (or resumed, ADR 0118) workflow whose run ended on its own is told
# (ADR 0072)
_REWOUND = (
    "DBOS.rewind_workflow (or DBOS.resume_workflow) does not reopen a finished run: "
    "DBOS.fork_workflow runs it again as a new workflow (a step that happened is not "
    "sent again)"
)


def _still_cancelled(workflow_id: str, key: str, run: RunRecord | None) -> str:
    """What a step refused at the gate of a cancelled run says (ADR 0085): a DBOS resume
    (``DBOS.resume_workflow``) does not lift stopline's cancel, which names a principal
    and is governed (R10, R11); a DBOS cancel can still be on its way. Either way the
    workflow is cancelled in DBOS again, which keeps it resumable there."""
    run_id = run_id_of(workflow_id)
    by = f" by {run.cancelled_by}" if run is not None and run.cancelled_by else ""
    reason = f" ({run.cancel_reason})" if run is not None and run.cancel_reason else ""
    return (
        f"DBOS workflow {workflow_id!r}: step {key!r} refused at the gate: its run "
        f"{run_id!r} was cancelled{by}{reason} and is not resumed, so the workflow is "
        "cancelled in DBOS again. DBOS.resume_workflow alone does not resume a run "
        f"stopline cancelled: resume the run first (ledger.resume({run_id!r}, by=...), "
        f"or 'stopline resume'), then DBOS.resume_workflow({workflow_id!r})"
    )


def _deadline() -> int | None:
    """The workflow's deadline in DBOS's context (its timeout), if it has one."""
    ctx = get_local_dbos_context()
    return ctx.workflow_deadline_epoch_ms if ctx is not None else None


async def _cancel_in_dbos(workflow_id: str, reason: str) -> None:
    """DBOS cancels only the workflow named: its children go by stopline's ownership.
    A database error DBOS does not retry is raised without the statement SQLAlchemy
    appends (it reaches ``ledger.health``'s log from a forwarded cancel, ADR 0118)."""
    try:
        await _outside_workflow(DBOS.cancel_workflow_async(workflow_id))
    except Exception as exc:
        told = short(exc)
        if told is exc:
            raise
        raise told from exc


async def _why_cut(workflow_id: str) -> NoAnswer | None:
    """Why DBOS cut a step whose run is not fenced: its workflow's cancel (its watcher
    saw ``DBOS.cancel_workflow`` or the workflow's timeout; the fence follows), ``None``;
    else the step's own ``timeout_seconds`` or a shutdown, which cancel no run and are not
    recorded as a cancel (ADR 0102)."""
    try:
        if await cancelled_in_dbos(workflow_id):
            return None
        why = "its timeout_seconds passed, or DBOS is shutting down"
    except Exception as exc:  # the call is cut either way: its cause is what is known
        why = f"DBOS could not say why: {describe(short(exc))}"
    return NoAnswer(Cause.LOCAL_ERROR, f"DBOS cut the step, its workflow not cancelled ({why})")


def _require_async(fn: Callable[..., Any]) -> None:
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"{fn!r}: stopline gates async DBOS workflows and steps only")


def _parent_id() -> str | None:
    """The run of the workflow's parent, if it has one."""
    ctx = get_local_dbos_context()
    parent = ctx.parent_workflow_id if ctx is not None else None
    return run_id_of(parent) if parent else None
