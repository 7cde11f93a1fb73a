"""A run as the workflow sees it: phases, gated calls, boundaries.

``Run.call`` is the dispatch gate's caller. For an effectful tool it records
the intent through the gate (one durable transaction) before the tool's
first byte leaves, then records what the call proved: ``committed`` on a
response (an awaitable is none: ``Tool.answer``), ``not_committed`` only on a
provider's refusal, and ``unknown`` on anything else (R3, ``exits``). A cancel
reaches a call according to the phase policy: ``immediate`` interrupts it,
``at_boundary`` and ``verify`` let it finish and stop the run right after (the
provider is asked to cancel meanwhile when it can).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from stopline.domain.guidance import OnResume, on_resume
from stopline.domain.lifecycle import Principal
from stopline.domain.limits import MAX_ID_CHARS, check_id, check_new_id, check_seconds
from stopline.domain.model import (
    Evidence,
    OperationRecord,
    OperationSpec,
    RunRecord,
    UnstableValue,
    args_digest,
    committed_evidence,
)
from stopline.domain.vocab import EvidenceKind, OpEvent, OpStatus, PhaseKind, Policy
from stopline.errors import InvalidInput, NotReplayable, OperationInDoubt, RunFenced
from stopline.ledger.backend import GateVerdict, OutcomeUpdate
from stopline.runtime.context import CallContext
from stopline.runtime.exits import record_exit
from stopline.runtime.lifecycle import ApprovalNeeded, Retry
from stopline.runtime.outcomes import INTERRUPTED
from stopline.runtime.replay import child_id, replay_gate
from stopline.runtime.tool import NoAnswer, Rejected, Tool

if TYPE_CHECKING:
    from stopline.domain.lifecycle import ApprovalRecord, Checkpoint
    from stopline.domain.receipt import Receipt
    from stopline.runtime.core import Core
    from stopline.runtime.ledger import Ledger
    from stopline.runtime.scope import RunScope

__all__ = ["INTERRUPTED", "Run"]

R = TypeVar("R")

# the operations this task is inside of (a tool that calls run.call, and its child tasks)
_CALLING: ContextVar[frozenset[str]] = ContextVar("stopline_calling", default=frozenset())


def _parameters(t: Tool[Any]) -> list[str]:
    """The names of a tool's own arguments (after its context)."""
    try:
        params = list(inspect.signature(t.fn).parameters)
    except (TypeError, ValueError):
        return []
    return params[1:] if t.wants_context else params


def _op_id(run_id: str, key: str | None, made: str) -> str:
    """A call's operation id, ``RUN_ID/KEY`` (``RUN_ID/SEQ:TOOL`` without a key); one
    past ``MAX_ID_CHARS`` is ``InvalidInput`` naming the key (else the tool) and the
    room this run's id leaves a key: the limit is the operation id's, not the key's.
    Which keys are taken is as ever; only what a refusal says is the truth."""
    op_id = f"{run_id}/{key if key is not None else made}"
    if len(op_id) > MAX_ID_CHARS:
        room = max(MAX_ID_CHARS - len(run_id) - 1, 0)
        if key is not None:
            raise InvalidInput(
                "key",
                f"{len(key)} characters; a call's operation id (the run's id, '/', the key) "
                f"has at most {MAX_ID_CHARS}, so a key in this run (an id of {len(run_id)} "
                f"characters) has at most {room}",
            )
        raise InvalidInput(
            "tool",
            f"the operation id of its call here (the run's id, '/', {made!r}) would have "
            f"{len(op_id)} characters, at most {MAX_ID_CHARS}: give the call a key of at "
            f"most {room}",
        )
    return check_id("key", op_id)


class Run:
    """Handle on one run inside ``async with ledger.run(...) as run``."""

    # its public attributes, declared on the class (set in ``__init__``): the scope that
    # makes it names them too, to one who reaches them on it (``RunScope.__getattr__``)
    id: str
    name: str
    owner: str
    tenant: str
    record: RunRecord
    policy: Policy
    phase_kind: PhaseKind | None
    cancel_requested: bool
    cancelled_caught: bool
    block_task_cancels: Callable[[], int] | None
    opened: int
    covered: bool
    pause_requested: bool
    suspended: bool
    replaying: bool

    def __init__(
        self,
        ledger: Ledger,
        core: Core,
        record: RunRecord,
        scope: anyio.CancelScope | None = None,
    ) -> None:
        self._ledger = ledger  # the facade: what a workflow may ask of it
        self._core = core  # the runtime's shared state
        self.id = record.id
        self.name = record.name
        self.owner = record.owner
        self.tenant = record.tenant
        self.record = record  # as created or attached: who owns it and in which tenant
        self.policy = record.policy
        self.phase_kind: PhaseKind | None = record.phase
        self._seq = 0
        self._scope = scope  # the block's, cancelled to interrupt its work
        self._inflight: dict[str, CallContext] = {}
        # calls cut locally before any cancel of the run: a cancel that follows asks them too
        self._cut: dict[str, CallContext] = {}
        self._call_ended: anyio.Event | None = None  # set (and dropped) when a call leaves
        # "a cancel was asked for" (committed to the ledger) ...
        self.cancel_requested = False
        # ... kept apart from "this run's work was interrupted" (cancelled_caught).
        self.cancelled_caught = False
        # how many cancels the task its block runs in has been asked, where the event
        # loop tells (asyncio's ``Task.cancelling``; set by the block): how a delivery
        # sees that an enclosing run's cancel, just delivered, reached this block too
        self.block_task_cancels: Callable[[], int] | None = None
        # where its block opened in this process's order of blocks (``Core.register_run``)
        self.opened = -1
        # the delivered cancel reached this block through an enclosing run's scope
        self.covered = False
        self.pause_requested = False
        # the workflow stopped to wait (a human's approval): its block ends, the run stays paused
        self.suspended = False
        self.replaying = False  # a child that ended, re-entered by its parent (ADR 0053)
        self._children: dict[str, int] = {}  # ``child_id``'s count of its children by name

    # -- the gate's caller ---------------------------------------------------
    async def call(
        self,
        tool: Tool[R] | Callable[..., Awaitable[R]],
        *args: Any,
        key: str | None = None,
        timeout: float | None = None,
        needs_approval: bool = False,
        retry: Retry | None = None,
        **kwargs: Any,
    ) -> R:
        """Run a tool. Effectful tools pass the gate first; reads go straight through.

        ``key`` names the operation (its idempotency key; by default the call's
        position in the run, so a replay recognises it). ``needs_approval``: the
        gate lets it pass only with a granted, unexpired approval for ``key``.
        ``timeout``: the deadline of the whole call, in seconds; past it the call is
        cut and recorded ``unknown`` (cause ``timeout``), then read back (R3). (The
        silence an MCP call may keep is ``StoplineMCP.call``'s ``idle_timeout``.)
        ``retry``: further attempts after a refusal, each through the gate.

        These four names are stopline's: a tool with an argument of the same name
        is refused here (``InvalidInput``) when the name is passed; call it with
        ``call_with(tool, args, kwargs, key=...)``, which takes the tool's
        arguments apart from stopline's options.
        """
        t: Tool[R] = tool if isinstance(tool, Tool) else self._core.adopt(tool)
        given = {
            "key": key is not None,
            "timeout": timeout is not None,
            "needs_approval": needs_approval,
            "retry": retry is not None,
        }
        # a tool's own argument named like an option given: only then is it looked at
        clash = [n for n in _parameters(t) if given.get(n)] if any(given.values()) else []
        if clash:
            raise InvalidInput(
                clash[0],
                f"tool {t.name!r} has its own {clash[0]!r} argument and {clash[0]!r} is "
                "stopline's option of run.call: pass the tool's arguments apart with "
                "run.call_with(tool, args, kwargs, key=...)",
            )
        return await self.call_with(
            t, args, kwargs, key=key, timeout=timeout, needs_approval=needs_approval, retry=retry
        )

    async def call_with(
        self,
        tool: Tool[R] | Callable[..., Awaitable[R]],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        timeout: float | None = None,
        needs_approval: bool = False,
        retry: Retry | None = None,
    ) -> R:
        """``call`` with the tool's arguments passed apart from stopline's options."""
        self._core.at_home("a run's calls are made")
        t: Tool[R] = tool if isinstance(tool, Tool) else self._core.adopt(tool)
        args, kwargs = tuple(args), dict(kwargs or {})
        t.check_arguments(args, kwargs)  # always one: the function's own, by default
        if not t.effects:
            return t.answer(await t.fn(*args, **kwargs))
        if key is not None:
            check_new_id("key", key)
        timeout = check_seconds("timeout", timeout)
        if retry is not None and not isinstance(retry, Retry):
            raise InvalidInput("retry", f"must be a stopline.Retry, not {type(retry).__name__}")
        try:  # equal arguments, equal digest, in every process; or refused now
            arguments = args_digest([list(args), kwargs])
        except UnstableValue as exc:  # named by its key, such a call is not compared
            if key is None:
                raise InvalidInput("arguments", f"{exc.path}: {exc.why}") from exc
            arguments = f"unstable:{exc.path}"
        self._core.register_tool(t)  # another tool by this name: refused, nothing written
        self._seq += 1
        op_id = _op_id(self.id, key, f"{self._seq}:{t.name}")
        spec = OperationSpec(
            id=op_id,
            run_id=self.id,
            tool=t.name,
            args_digest=arguments,
            description=t.description,
            cancellable=t.cancellable,
            can_verify=t.verify_fn is not None,
            can_compensate=t.compensate_fn is not None,
            worker=self._core.worker_id,
            needs_approval=needs_approval,
        )
        if retry is None:
            return await self._gated(t, spec, args, kwargs, timeout, replayed=False)
        for delay in [*retry.delays(), None]:
            try:
                return await self._gated(t, spec, args, kwargs, timeout, replayed=False)
            except (Rejected, NoAnswer, TimeoutError, ConnectionError):
                if delay is None:
                    raise
            await anyio.sleep(delay)  # the next attempt passes the gate again (R1)
        raise AssertionError("unreachable")

    async def _gated(
        self,
        t: Tool[R],
        spec: OperationSpec,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        *,
        replayed: bool,
    ) -> R:
        backend = self._core.backend  # a replaying block reads what happened, never writes
        outcomes = self._core.outcomes
        gate = await (replay_gate(backend, self, spec) if self.replaying else outcomes.gate(spec))
        while gate.verdict is GateVerdict.PAUSED:
            await self._core.wait_while_paused(self.id)
            gate = await outcomes.gate(spec)
        if gate.verdict is GateVerdict.PREVENTED:
            raise await self._fence(spec.id)
        if gate.verdict is GateVerdict.NEEDS_APPROVAL:
            raise ApprovalNeeded(spec.id, await self._ledger.why_not_approved(self.id, spec.id))
        if gate.verdict is GateVerdict.EXISTING:
            assert gate.operation is not None
            op = gate.operation
            if op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW) and not replayed:
                # in doubt: read back first (R5, reads only); retry only if it never happened
                op = await self._ledger.verify(op.id)
                if op.status is OpStatus.NOT_COMMITTED:
                    return await self._gated(t, spec, args, kwargs, timeout, replayed=True)
            if op.status is OpStatus.PREVENTED:
                raise await self._fence(op.id)
            return self._replay(op)  # type: ignore[no-any-return]
        ctx = CallContext(self._core, self.id, spec.id, t)  # type: ignore[arg-type]
        if self.cancel_requested:  # the cancel landed between our gate and our first byte
            await self._core.outcomes.not_sent(spec.id, by_run=True)
            raise await self._fence(spec.id)
        await self._core.outcomes.unless_cancelled(spec.id)  # its caller's, likewise
        self._inflight[spec.id] = ctx
        inside = _CALLING.set(_CALLING.get() | {spec.id})
        try:
            result = await self._dispatch(t, ctx, args, kwargs, timeout)
        except anyio.get_cancelled_exc_class():
            if not self.cancel_requested:
                # cut by its caller's own cancel (a framework's native cancel cuts the
                # tool's task before it fences the run): its provider may be at work still
                self._cut[spec.id] = ctx
            raise
        except Exception as exc:
            if self.cancel_requested:  # the provider's answer to our cancel: unwind quietly
                raise await self._fence(spec.id) from exc
            raise
        finally:
            _CALLING.reset(inside)
            del self._inflight[spec.id]
            if self._call_ended is not None:
                self._call_ended.set()
                self._call_ended = None
        if self.cancel_requested:
            raise await self._fence(None)  # the boundary after a recorded response
        return result

    async def _fence(self, op_id: str | None) -> RunFenced:
        """The fence, raised where a call meets it: under ``verify`` and ``at_boundary``
        only once every other call of this run in flight has left (R2: the policy lets
        them finish; a ``RunFenced`` leaving first would have the caller's task group
        interrupt them, and an interrupted call is ``unknown``). Calls this task is
        inside of (a tool calling ``run.call``) are not waited for."""
        self.cancel_requested = True
        mine = _CALLING.get()
        while self.policy is not Policy.IMMEDIATE and any(o not in mine for o in self._inflight):
            if self._call_ended is None:
                self._call_ended = anyio.Event()
            await self._call_ended.wait()
        return RunFenced(self.id, op_id)

    def _replay(self, op: OperationRecord) -> Any:
        """R10: a committed operation is never repeated; its recorded result is returned
        (``on_resume``: the same rule a receipt's recovery line is derived from, R14)."""
        if on_resume(op.status) is OnResume.REPLAYED:
            # not kept: raises; read back without one: None, so a resume goes on (ADR 0049)
            if op.result_not_kept is not None:
                raise NotReplayable(op.id, op.result_not_kept)
            return op.result
        if op.status is OpStatus.PREVENTED:
            self.cancel_requested = True
            raise RunFenced(self.id, op.id)
        raise OperationInDoubt(op.id, op.status)

    async def _dispatch(
        self,
        t: Tool[R],
        ctx: CallContext,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
    ) -> R:
        """Run the tool; every way out of it records an outcome (R2) before it leaves."""
        core = self._core
        call_args = (ctx, *args) if t.wants_context else args
        try:
            if timeout is None:
                result = t.answer(await t.fn(*call_args, **kwargs))
            else:
                with anyio.fail_after(timeout):
                    result = t.answer(await t.fn(*call_args, **kwargs))
        except BaseException as exc:
            ctx.answered = True
            await record_exit(core, ctx, exc, timeout, cancelled=self.cancel_requested)
            raise
        ctx.answered = True
        evidence, kept = committed_evidence(result)  # an answer: it happened, whatever it holds
        if ctx.provider_ref and not ctx.is_accepted:  # else recorded at acceptance already
            evidence.insert(0, Evidence(EvidenceKind.PROVIDER_RECEIPT, ctx.provider_ref))
        update = OutcomeUpdate(
            OpEvent.COMMITTED, evidence, result=result if kept else None, has_result=kept
        )
        if not core.durable_outcomes and core.backend.defers_outcomes:
            # queued in order now, committed with the next group commit (ADR 0022)
            core.outcomes.defer(ctx.op_id, update)
        else:
            with anyio.CancelScope(shield=True):  # held if the ledger cannot take it
                await core.outbox.record(ctx.op_id, update)
        return result

    # -- phases and boundaries -------------------------------------------------
    @contextlib.asynccontextmanager
    async def phase(self, kind: PhaseKind, policy: Policy | None = None) -> AsyncIterator[None]:
        """A named stretch with its cancel policy; entering and leaving are boundaries."""
        self.boundary()
        previous = (self.phase_kind, self.policy)
        self.phase_kind, self.policy = kind, policy or kind.default_policy
        await self._core.backend.set_phase(self.id, kind, self.policy)
        try:
            yield
        finally:
            self.phase_kind, self.policy = previous
        self.boundary()

    def child(self, name: str, *, shared: bool = False, run_id: str | None = None) -> RunScope:
        """A sub-agent's run, owned by this one (exclusively unless ``shared``); by default
        its id is ``child_id``'s: a resumed parent reaches the same child (ADR 0053)."""
        derived = child_id(self.id, name, self._children)
        return self._ledger.run(
            name,
            owner=self.owner,
            tenant=self.tenant,
            run_id=derived if run_id is None else run_id,
            parent_id=self.id,
            shared=shared,
        )

    async def checkpoint(self, name: str, state: Any = None) -> Checkpoint:
        """An evidenced checkpoint (R10): refused while any operation is unresolved."""
        return await self._core.backend.checkpoint(self.id, name, state)

    async def request_approval(self, key: str, *, approver: str) -> ApprovalRecord:
        """Ask ``approver`` for the operation ``key`` (call it with ``needs_approval=True``)."""
        by = Principal(self.owner, tenant=self.tenant)  # the run's owner, of its tenant
        return await self._ledger.request_approval(self.id, key, approver=approver, by=by)

    async def suspend(self, reason: str) -> Receipt:
        """Stop here without ending: the run is paused (R9) and leaving its block does not
        complete it. For a workflow that waits for a person (an approval, an answer); it
        continues after ``ledger.resume`` in a new block on the same run id."""
        self.suspended = True
        return await self._ledger.pause(self.id, by=self.owner, reason=reason)

    def boundary(self) -> None:
        """A safe point: raise ``RunFenced`` if a cancel was committed."""
        if self.cancel_requested:
            raise RunFenced(self.id)

    async def receipt(self) -> Receipt:
        return await self._ledger.receipt(self.id)

    # -- delivery of a committed cancel (called by the ledger) -----------------
    @property
    def in_flight(self) -> tuple[CallContext, ...]:
        """The calls of this run in flight in this process now."""
        return tuple(self._inflight.values())

    def awaits_a_tool(self) -> bool:
        """A call of this run is in flight here and its tool has not answered: its
        operation is unresolved, so the run has not been resumed since any cancel of it
        (R10; ADR 0041)."""
        return any(not ctx.answered for ctx in self._inflight.values())

    def at_providers(self) -> list[CallContext]:
        """The calls a cancel of this run asks providers about: those in flight here,
        and those cut locally just before (their provider may not have stopped)."""
        calls = [*self._inflight.values(), *self._cut.values()]
        self._cut.clear()
        return calls

    def ask_providers_to_cancel(self) -> None:
        """Ask the provider of each call in flight to cancel it, as a committed cancel
        does (for an engine whose own cancel reaches the calls before stopline's)."""
        for ctx in self.in_flight:
            self._core.settler.ask_provider_cancel(ctx)

    def deliver_cancel(self, *, covered: bool = False) -> bool:
        """Interrupt by policy: ``immediate`` always; ``verify`` when no call is in flight
        (nothing to prove); ``at_boundary`` never (the step finishes, the next boundary stops).

        ``covered``: the cancel of an enclosing run, delivered just before in the same
        step, has reached this block's task (``Lifecycle.deliver_cancel`` proves it);
        this block is interrupted by that cancel, not by one of its own.
        """
        self.cancel_requested = True
        interrupt = self.policy is Policy.IMMEDIATE or (
            self.policy is Policy.VERIFY and not self._inflight
        )
        if self._scope is not None and interrupt:
            if covered:
                self.covered = True
            else:
                self._scope.cancel()
            return True
        return False
