"""What the durable-engine integrations (``temporal``, ``dbos``) share, written once.

A durable engine runs a workflow as a sequence of activities (Temporal) or
steps (DBOS), each at least once: a worker crash after the side effect and
before the engine's checkpoint runs it again. Both integrations map the
engine onto the contract the same way:

- **A run per workflow.** The stopline run's id is the engine's workflow id,
  so ``stopline receipt WORKFLOW_ID`` answers for any workflow. A child
  workflow is a child run, owned exclusively unless declared shared (R6).
- **An operation per activity or step**, keyed by what the engine keeps
  stable across retries and crashes (Temporal: run id and activity id;
  DBOS: the step's function id). A re-execution reaches the same operation:
  a committed one returns its recorded result, one in doubt is read back
  first (R5), and none is re-sent blind.
- **The engine's cancel reaches the call by policy** (``EngineGate.call``):
  the body runs in a task of its own, so the engine's cancel of the awaiting
  task does not cut it by itself. ``immediate``: the body is interrupted and
  the operation is ``unknown`` (R3) until evidence; ``verify`` and
  ``at_boundary``: the provider is asked to cancel when it can and the body
  finishes, its outcome recorded. A completion that lands after the run was
  fenced is kept as late evidence (R4).
- **One rule for an engine's ids** (ADRs 0050, 0085): a workflow id is the run's id
  when it fits and is printable, else its start and a digest (``engine_run_id``);
  a step's or activity's name or id in an operation's key likewise (``engine_key``).
  An engine accepts ids the ledger cannot keep as they are; its workflow runs, never
  refused for its id.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from stopline.domain.lifecycle import operator, tenant_of
from stopline.domain.limits import fitted
from stopline.domain.model import RunRecord
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import Policy, RunState
from stopline.errors import NoAnswer, NotPermitted, UnknownRun
from stopline.ledger.backend import RunSpec
from stopline.runtime.context import CallContext
from stopline.runtime.ledger import Ledger
from stopline.runtime.run import Run
from stopline.runtime.tool import Tool, Verdict

__all__ = [
    "ENDED_ON_ITS_OWN",
    "KEY_ROOM",
    "RUN_ROOM",
    "EngineCancel",
    "EngineCut",
    "EngineGate",
    "Unstarted",
    "call_context",
    "cancel_collecting",
    "engine_key",
    "engine_run_id",
    "find_run",
    "resumed_after_cancel",
]

R = TypeVar("R")
# how an integration cancels one of its engine's workflows: (workflow id, reason)
EngineCancel = Callable[[str, str], Awaitable[None]]
# why the engine cut a call when its run was not fenced (a timeout, the workflow's own
# cancel of the activity): the ``NoAnswer`` its operation is recorded ``unknown`` with
# (it may ask the engine: a timeout the engine's server decided is in its records);
# ``None``: the engine's cancel of the workflow, whose fence is on its way (DBOS's)
EngineCut = Callable[[], Awaitable[NoAnswer | None]]
# the run a cancel creates, already fenced, for a workflow the engine holds but has not
# started yet (queued): ``None`` when the engine knows no such workflow either
Unstarted = Callable[[], Awaitable[RunSpec | None]]

# an operation's id is ``RUN/EXECUTION:KEY`` (Temporal: the execution's run id, a UUID;
# DBOS: the step's function id) in at most 1024 characters (MAX_ID_CHARS): a run's id
# takes at most RUN_ROOM of them, an activity's id or a step's name at most KEY_ROOM,
# and the rest is the execution and the separators
RUN_ROOM = 890
KEY_ROOM = 96


def engine_run_id(workflow_id: str) -> str:
    """The stopline run of an engine's workflow id (ADRs 0050, 0085): the id itself when
    it has at most ``RUN_ROOM`` characters, no control character and no marker of a
    derived id, else its printable start and the SHA-256 of all of it
    (``HEAD#sha256:HEX``): stable across processes and releases, so that every worker
    and ``stopline show`` find the same run. Never a refusal: the engine runs the id."""
    return fitted(workflow_id, RUN_ROOM)


def engine_key(name: str) -> str:
    """An activity's id or a step's name as it is in an operation's key: itself when it
    fits ``KEY_ROOM`` and is printable, else derived as ``engine_run_id`` derives."""
    return fitted(name, KEY_ROOM)


# the states of a run whose workflow ended by itself (no cancel): nothing in it will run
ENDED_ON_ITS_OWN = frozenset({RunState.COMPLETED, RunState.FAILED})

_REMEMBER_FENCED = 10_000
K = TypeVar("K")
V = TypeVar("V")


def _remember(kept: dict[K, V], key: K, value: V) -> None:
    """``kept[key] = value``, the oldest entries let go past ``_REMEMBER_FENCED``."""
    kept[key] = value
    while len(kept) > _REMEMBER_FENCED:
        del kept[next(iter(kept))]


# the run states in which the run holds ``initiate`` (not fenced; a resumed run too)
_LIVE = frozenset({RunState.RUNNING, RunState.PAUSING, RunState.PAUSED})

_CALL: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar(
    "stopline_engine_call", default=None
)


def resumed_after_cancel(run: RunRecord) -> bool:
    """Whether the run was cancelled and resumed since: it holds ``initiate`` again."""
    return run.cancelled_at is not None and run.state in _LIVE


async def find_run(ledger: Ledger, run_id: str) -> RunRecord | None:
    """The run as the ledger has it now (not a process's copy), if it exists."""
    try:
        return await ledger.backend.get_run(run_id)
    except UnknownRun:
        return None


async def cancel_collecting(
    ledger: Ledger, run_id: str, *, by: str, reason: str, unstarted: Unstarted | None = None
) -> tuple[Receipt, list[str]]:
    """``ledger.cancel``, and every run its fence reached (the run, its exclusive
    descendants), for an engine to cancel in turn.

    A run the ledger does not know may belong to a workflow the engine holds but
    has not started (queued): ``unstarted`` gives its run, created here and fenced
    at once, so that the workflow does nothing when it starts (its run refuses
    every gate) and the engine's cancel is still asked for. ``UnknownRun`` only when
    the engine knows no such workflow either."""
    fenced: list[str] = [run_id]
    stop_listening = ledger.on_cancel(fenced.extend)
    try:
        try:
            receipt = await ledger.cancel(run_id, by=by, reason=reason)
        except UnknownRun:
            spec = None if unstarted is None else await unstarted()
            if spec is None:
                raise
            with contextlib.suppress(Exception):  # its workflow started and opened it meanwhile
                await ledger.backend.create_run(spec)
            receipt = await ledger.cancel(run_id, by=by, reason=reason)
    finally:
        stop_listening()
    return receipt, list(dict.fromkeys(fenced))


def call_context() -> CallContext:
    """The current activity's or step's stopline call: its ``key`` is the idempotency
    key to hand to the provider; ``await call_context().accepted(ref)`` records the
    provider's acknowledgement."""
    ctx = _CALL.get()
    if ctx is None:
        raise LookupError("not inside a gated activity or step")
    return ctx


class EngineGate:
    """One engine's bridge to a ledger: runs, gated calls, fences."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        engine: str,
        owner: str,
        tenant: str = "default",
        tools: Sequence[Tool[Any]] = (),
    ) -> None:
        self.ledger = ledger
        self.engine = engine
        self.owner = owner
        self.tenant = tenant
        # the engine acts on runs as an operator: its own cancel is an operator's act
        self.principal = operator(engine)
        self._tools = {t.name: t for t in tools}
        for t in tools:
            ledger.register_tool(t)
        self._records: dict[str, RunRecord] = {}  # the runs of workflows still going
        # runs this process has seen fenced (the latest ones): a hint only, which
        # ``is_fenced`` confirms in the ledger, since a resume (in any process) lifts
        # the fence without telling this one; a resumed run leaves it there
        self.fenced: dict[str, None] = {}
        # the engine's id of each run whose id is not it (derived: ``fitted``, ADR 0050)
        self.engine_ids: dict[str, str] = {}
        self._engine_cancel: EngineCancel | None = None
        self._forwarded: dict[str, float | None] = {}  # run -> the cancel asked of the engine
        self._listening = [ledger.on_cancel(self._saw_fence)]

    def close(self) -> None:
        """Stop listening to the ledger's cancels."""
        for stop in self._listening:
            stop()
        self._listening.clear()

    def _saw_fence(self, run_ids: Sequence[str]) -> None:
        for run_id in run_ids:
            self._records.pop(run_id, None)
            _remember(self.fenced, run_id, None)

    # -- stopline -> the engine ------------------------------------------------------
    def forward_cancels(self, cancel: EngineCancel) -> None:
        """Carry every stopline cancel this process learns of into the engine:
        ``cancel(workflow_id, reason)`` for each fenced run that is one of its
        workflows (the run and the children it owns exclusively)."""
        self._engine_cancel = cancel
        self._listening.append(self.ledger.on_cancel(self.cancel_in_engine))

    def cancel_in_engine(self, run_ids: Sequence[str]) -> None:
        """Ask the engine to cancel these runs' workflows (in the background)."""
        if self._engine_cancel is not None:
            self.ledger.spawn(self.forward, list(run_ids))

    async def forward(self, run_ids: Sequence[str]) -> None:
        """Ask the engine to cancel these runs' workflows now: those of its workflows whose
        current cancel it was not asked already (once per cancel: this process hears of
        one from its own return and from the ledger's notification)."""
        cancel = self._engine_cancel
        if cancel is None:
            return
        for run_id in run_ids:
            try:
                run = await self.ledger.backend.get_run(run_id)
            except UnknownRun:
                continue
            if not self.owns(run) or self._forwarded.get(run_id) == run.cancelled_at:
                continue  # not the engine's, or this cancel asked already (its own
                # return and its notification both tell this process of it)
            _remember(self._forwarded, run_id, run.cancelled_at)
            engine_id = self.engine_ids.get(run_id, run_id)
            try:
                await cancel(engine_id, run.cancel_reason or "stopline cancel")
            except BaseException:
                self._forwarded.pop(run_id, None)  # not asked: a retry (or notice) asks again
                raise

    def run_name(self, workflow: str) -> str:
        return f"{self.engine}:{workflow}"

    def owns(self, run: RunRecord) -> bool:
        """Whether the run is one of this engine's workflows."""
        return run.name.startswith(f"{self.engine}:")

    def tool(self, name: str) -> Tool[Any]:
        """The tool declared for an activity or step, else an effectful one with no
        capabilities (its outcome in doubt goes to review)."""
        found = self._tools.get(name)
        if found is None:
            found = self._tools[name] = Tool(_never_called, name=name)
        return found

    # -- runs --------------------------------------------------------------------
    async def open_run(
        self, run_id: str, workflow: str, *, parent_id: str | None = None, shared: bool = False
    ) -> RunRecord:
        """The workflow's run: created at its first start, attached on every re-run.
        ``NotPermitted`` when a run of that id exists and is not one of this engine's
        workflows, or is another tenant's (ADR 0072)."""
        record = self._records.get(run_id)
        if record is not None:
            return record
        backend = self.ledger.backend
        try:
            record = await backend.get_run(run_id)
        except UnknownRun:
            spec = RunSpec(
                id=run_id,
                name=self.run_name(workflow),
                owner=self.owner,
                tenant=self.tenant,
                parent_id=parent_id,
                shared=shared,
            )
            try:
                record = await backend.create_run(spec)
            except Exception as exc:  # another worker created it meanwhile, or a real error
                try:
                    record = await backend.get_run(run_id)
                except UnknownRun:
                    raise exc from None
        if not self.owns(record) or tenant_of(record) != self.tenant:
            # another's run under the same id (an agent's, another engine's, another
            # tenant's app on one ledger): joined, its operations would be this workflow's
            # and the workflow's end would end it
            whose = record.name if self.owns(record) else f"{record.name!r}"
            raise NotPermitted(
                f"run {run_id!r} is not a {self.engine} workflow's of tenant {self.tenant!r}"
                f" (it is {whose}, tenant {tenant_of(record)!r}): a {self.engine} workflow"
                " does not join it; give the workflow another id"
            )
        self._records[run_id] = record
        return record

    def remember_engine_id(self, run_id: str, engine_id: str) -> None:
        """``run_id`` is the engine's ``engine_id`` (a derived id: ``fitted``)."""
        if run_id != engine_id:
            _remember(self.engine_ids, run_id, engine_id)

    async def end_run(self, run_id: str, error: BaseException | None = None) -> None:
        """The workflow ended on its own (``completed``, or ``failed`` with ``error``)."""
        self._records.pop(run_id, None)
        self.engine_ids.pop(run_id, None)
        await self.ledger.end(run_id, by=self.owner, error=error)

    async def fence(self, run_id: str, reason: str) -> Receipt:
        """The engine cancelled the workflow: fence the run (durably, first)."""
        self._saw_fence([run_id])
        return await self.ledger.cancel(run_id, by=self.principal, reason=reason)

    async def is_fenced(self, run_id: str) -> bool:
        """Whether the run is cancelled now (not merely ended: a workflow may complete
        while the engine's cancel of one of its calls is on its way; not resumed since:
        a resumed run holds ``initiate`` again). Read from the ledger every time: a
        fence this process saw may have been lifted by a resume in another."""
        run = await self.ledger.backend.get_run(run_id)
        if run.cancelled_at is None or resumed_after_cancel(run):
            self.fenced.pop(run_id, None)
            return False
        self._saw_fence([run_id])
        return True

    # -- the gated call ------------------------------------------------------------
    async def call(
        self,
        run_id: str,
        workflow: str,
        key: str,
        tool: Tool[Any],
        body: Callable[[], Awaitable[R]],
        args: Sequence[Any],
        *,
        policy: Policy,
        cut: EngineCut | None = None,
        settles_within: float | None = None,
    ) -> R:
        """Run ``body`` as the operation ``run_id/key`` through the gate.

        Raises what ``Run.call`` raises (``RunFenced`` when the gate refuses,
        ``OperationInDoubt``, ``Rejected``, ...), and ``asyncio.CancelledError``
        when the engine's cancel ended the call. ``cut`` says why the engine cut
        an ``immediate`` call of a run that is not fenced (``None``: a cancel of the
        run after all); without it the cut is taken for a cancel of the run.
        ``settles_within``: the engine's bound, in seconds after dispatch, on when the
        call's effect lands or never will (its timeout), stated as the call's horizon
        (R13, ``CallContext.settles_by``); a provider may state an earlier one. A call
        left without an answer after it has the moment it left plus the bound instead
        (``_ran_past_its_bound``).
        """
        record = await self.open_run(run_id, workflow)
        run = Run(self.ledger, self.ledger.core, record)
        run.policy = policy
        sent: list[bool] = []  # set when this call dispatched the body (not a replay)
        why: list[NoAnswer] = []  # set when the engine cut the body for a reason of its own
        bound = _bound(tool, body, sent, why, settles_within)
        task = asyncio.create_task(run.call(bound, *args, key=key))
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise
            result = await self._cancelled(run, task, policy, cut, why)
        # R4: kept, attached to its operation, nothing restarted (a run resumed since
        # it was fenced is live again: its calls are no late answers)
        if sent and run_id in self.fenced and await self.is_fenced(run_id):
            await self.ledger.late_response(
                f"{run_id}/{key}", Verdict.COMMITTED, result=result, detail="after the cancel"
            )
        return result

    async def _cancelled(
        self,
        run: Run,
        task: asyncio.Task[R],
        policy: Policy,
        cut: EngineCut | None,
        why: list[NoAnswer],
    ) -> R:
        """The engine cancelled the awaiting task while the body runs."""
        run.ask_providers_to_cancel()
        if policy is Policy.IMMEDIATE:
            # the cause recorded is what happened: a cancel of the run (its fence is
            # durable before the engine's cancel reaches the call, or the engine's cancel
            # of the workflow is on its way to it), else the engine's own
            if cut is None or await self.is_fenced(run.id) or (cause := await cut()) is None:
                run.cancel_requested = True  # the body's abort is recorded as the cancel's
            else:
                why.append(cause)  # the body leaves with it: ``unknown``, by that cause (R3)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise asyncio.CancelledError
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()  # the engine asked once; the outcome decides what it hears
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:  # asked again (a shutdown): stop waiting, keep truth
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise
        except Exception as exc:  # it did not complete: the engine hears its cancel took
            raise asyncio.CancelledError from exc


def _ran_past_its_bound(ctx: CallContext, within: float | None) -> None:
    """R13 for the engine's bound (ADR 0085, amendment): it is the horizon of a call
    whose code ended within it. A call that left without an answer after it (a worker
    frozen past its timeout, and cut when it went on) ran until now, and what it sent
    until now may still land: its horizon is now plus the engine's bound, the allowance
    an attempt had, counted from its cut. A horizon the provider stated earlier than the
    engine's is the provider's promise and stays (ADR 0069)."""
    stated = ctx.stated_horizon
    if within is None or stated is None or stated < ctx.started_at + within:
        return
    now = time.time()
    if now >= stated:
        ctx.stated_horizon = now + within  # recorded with the call's ``unknown`` (R3)


async def _never_called() -> None:  # pragma: no cover - the body is always bound
    raise AssertionError("an engine tool runs its bound body")


def _bound(
    tool: Tool[Any],
    body: Callable[[], Awaitable[R]],
    sent: list[bool],
    why: list[NoAnswer],
    settles_within: float | None = None,
) -> Tool[R]:
    """``tool``'s capabilities around this one call's body; the body sees its context,
    and leaves with ``why`` when the engine cut it for a reason of its own. The tool's
    declared horizon (``settles_within``) is the bound call's, so that a cut records it
    with the call's ``unknown`` (R13: the receipt says until when, and it holds in a
    process that does not declare the tool); the engine's bound is the call's stated
    horizon (written in the background: it outlives a crash), unless the call's code ran
    past it."""

    async def run_body(ctx: CallContext, *_args: Any) -> R:
        sent.append(True)
        if settles_within is not None:
            ctx.settles_by(ctx.started_at + settles_within)
        token = _CALL.set(ctx)
        try:
            return await body()
        except BaseException as exc:  # no answer: its horizon is never before this moment
            _ran_past_its_bound(ctx, settles_within)
            if why and isinstance(exc, asyncio.CancelledError):
                raise why[0] from None
            raise
        finally:
            _CALL.reset(token)

    bound: Tool[R] = Tool(
        run_body,
        name=tool.name,
        description=tool.description,
        effects=True,
        cancellable=tool.cancellable,
        compensation=tool.compensation,
        settles_within=tool.settles_within,
    )
    bound.cancel_fn = tool.cancel_fn
    bound.verify_fn = tool.verify_fn
    bound.compensate_fn = tool.compensate_fn
    bound.compensation_verify_fn = tool.compensation_verify_fn
    return bound
