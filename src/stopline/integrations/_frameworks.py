"""What the agent-framework adapters share.

Each adapter (``langgraph``, ``pydantic_ai``, ``openai_agents``) does three
things the same way, so they live here once:

- **The current run.** ``bind(ledger, run)`` makes a stopline ``Run`` the one
  that framework tools called in this context (and the tasks it starts) pass
  through the gate of. A framework tool called with no bound run raises.
- **Gated calls of framework tools.** ``gated_call`` runs one call of a
  side-effecting tool as a stopline operation keyed by the framework's own id
  (``tool_call_id``, ``call_id``, a LangGraph task id), so a retry or a resume
  that reaches the same call returns the recorded result instead of repeating it.
- **Sync tools finish in a thread the adapter owns (R4)**, ``_detached``: a
  ``def`` tool's thread is started from the ledger's task group, its answer is
  attached late when the framework stopped waiting, and whatever it raises (a
  ``BaseException`` too) is its own call's answer, never the task group's.

- **MCP tools run beside the framework (``mcp_call``).** A call of an MCP
  tool through ``StoplineMCP`` runs in the ledger's task group, so the
  framework's own cancel (which only stops *waiting*) never cuts it halfway
  through stopline's cancel protocol: the run's policy decides. Under
  ``verify`` the server is asked to cancel and its own record confirms or
  refuses; under ``immediate`` the call is cut, recorded ``unknown`` and
  verified through ``stopline_verify``.

The cancel side is ``Bound.cancel``: the fence is committed first (R1: nothing
passes the gate after it), then the framework's own cancel is applied. The
framework's *own* cancels (its cancel method, cancelling the task) reach
``Bound.native_cancel``, which commits the same stopline cancel, so the run ends
``cancelled`` with its receipt, never ``completed`` or ``failed``. A cancel
method the caller does not await (the Agents SDK's) commits it at once in the
ledger's task group (``Bound.native_cancel_soon``), and the run's block does not
end before it is on record.

**Where the framework's run ended (``Bound.ended``)**, the one rule of every
entry point of an adapter (``s.run``, ``s.iter``, ``s.stream``, the events of
``s.run_streamed``): cancelled, by stopline or by anyone through the
framework, it is the stopline cancel (``RunFenced`` ends the block quietly);
stopped to wait for approvals, the run is paused, never completed.

**Resume without the framework's history (``Bound.key_for``).** A model asked
again after a cancel issues its calls under new ids. A call whose id the run
has not recorded, with the same tool and the same arguments as an operation
recorded by an earlier entry of the run, is that operation: it gets its key,
so the gate replays what committed (or verifies what is in doubt) instead of
repeating it. Each recorded operation is matched at most once per entry, in
the order it was recorded; a further identical call is a new operation. "The
same arguments" is the digest the gate records (``args_digest``), one function:
a date, a UUID or an enum compares as the gate wrote it.

**A call id the framework reuses (ADR 0054).** A framework's call id names one
operation of the run: the same id with the same arguments is that call again
(replayed), the same id with other arguments is refused before anything is
sent, with an error that says the id was reused. Two calls of one id at once
(one message naming it twice) go one after the other (``_call_ids``, ADR 0068).

**A result that was not kept** (``result_not_replayable`` evidence, the
runtime's replay check), or none recorded (a commit a read-back or a reviewer
proved, ``_replayed``), is never handed to the model as ``None``: a replayed
tool call answers with ``unkept_note``.

**Waiting for a person (``Bound.suspend``).** When the framework stops to ask
for an approval, the run is paused, not completed: ``run.suspend`` (R9), with
a stopline approval request per waiting call, so that call passes the gate
only once that approval is granted.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any

import anyio

from stopline.domain.lifecycle import ApprovalRecord, ApprovalStatus, Principal
from stopline.domain.model import args_digest
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import Cancellable, Policy, RunState
from stopline.errors import (
    IdempotencyConflict,
    InvalidInput,
    NoRun,
    NotFound,
    NotReplayable,
    RunFenced,
    RunPaused,
    UnstableValue,
)
from stopline.integrations._call_ids import CallIds, inside, refused_replay, unkept_note
from stopline.integrations._detached import Work, detached_tool
from stopline.integrations._open_calls import open_calls
from stopline.integrations._replayed import told
from stopline.integrations._verify import VerifyByKey, as_verifier, read_verify, wants_context
from stopline.runtime.context import CallContext
from stopline.runtime.ledger import Ledger
from stopline.runtime.run import Run
from stopline.runtime.tool import CancelFn, Tool, Verifier

if TYPE_CHECKING:
    from stopline.integrations.mcp import StoplineMCP

__all__ = [
    "Bound",
    "NoRun",
    "RunPaused",
    "ToolSpec",
    "VerifyByKey",
    "Work",
    "as_verifier",
    "bind",
    "current",
    "detached_tool",
    "gated_call",
    "mcp_call",
    "mcp_offered",
    "open_run",
    "read_verify",
    "stopline_tool",
    "unkept_note",
]


@dataclasses.dataclass(eq=False)
class Bound:
    """A stopline run bound to one framework execution."""

    ledger: Ledger
    run: Run
    # how to apply the framework's own cancel once the fence is committed
    interrupt: Callable[[], None] = lambda: None
    approver: str = ""  # who is asked when the framework waits for an approval
    # the session's own end when the run's block ends (the Agents SDK: a run still going)
    leaving: Callable[[], Awaitable[None]] | None = None
    session: Any = None  # the adapter's session object (``GraphRun``, ``AgentSession``)
    # (tool, args digest) -> keys recorded by earlier entries, not yet matched
    _prior: dict[tuple[str, str], list[str]] | None = None
    _recorded: set[str] = dataclasses.field(default_factory=set)
    _approvals: set[str] = dataclasses.field(default_factory=set)  # scopes asked for
    _native: str | None = None  # why the framework's cancel method was called, if it was
    calls: CallIds = dataclasses.field(default_factory=CallIds)  # in flight, by key

    async def cancel(self, *, by: str | Principal, reason: str = "") -> Receipt:
        """Fence the run (durably, first), then cancel the framework's work.

        Returns the receipt as it stands at the cancel; ``ledger.wait_settled``
        gives the final one.
        """
        receipt = await self.ledger.cancel(self.run.id, by=by, reason=reason)
        self.interrupt()
        return receipt

    async def native_cancel(self, reason: str) -> None:
        """The framework cancelled on its own: commit the stopline cancel (by the owner).

        Shielded: it runs while the task that saw the cancel is unwinding.
        """
        if self.run.cancel_requested:
            return  # stopline's own cancel, delivered through the framework
        with anyio.CancelScope(shield=True):
            await self.ledger.cancel(self.run.id, by=self.run.owner, reason=reason)
        self.interrupt()  # and the framework's work that goes on beside the cancelled task

    def native_cancel_soon(self, reason: str) -> None:
        """``native_cancel`` from a cancel method its caller does not await: committed at
        once in the ledger's task group; ``native_committed`` waits for it."""
        if self.run.cancel_requested or self._native is not None:
            return
        if self.ledger.local_run(self.run.id) is not self.run:
            return  # the run's block has ended: the framework's cancel is its own
        self._native = reason
        self.ledger.spawn(self.native_cancel, reason)

    async def native_committed(self) -> None:
        """Until the cancel of ``native_cancel_soon`` is on record (idempotent, R7)."""
        if self._native is not None:
            await self.native_cancel(self._native)

    async def ended(self, *, cancelled: str | None = None, waiting: Collection[str] = ()) -> None:
        """The framework's run ended; ``cancelled`` says why when it was cancelled.

        Cancelled (by stopline, or by anyone through the framework) is the stopline
        cancel: committed if it is not yet, then ``RunFenced`` ends the run's block
        quietly. Stopped to wait for approvals of the calls ``waiting``: the run is
        paused (R9), never completed; unless a cancel was committed meanwhile (R1)."""
        await self.native_committed()
        if cancelled is not None:
            await self.native_cancel(cancelled)
            raise RunFenced(self.run.id)
        if waiting and not self.run.cancel_requested:
            await self.suspend(waiting, f"awaiting approval of {len(waiting)} tool calls")

    @contextlib.asynccontextmanager
    async def native_cancels(self) -> AsyncIterator[None]:
        """Cancelling the task that runs the framework is a stopline cancel (by the owner)."""
        try:
            yield
        except anyio.get_cancelled_exc_class():
            await self.native_cancel("the task running the agent was cancelled")
            raise

    @property
    def resumed(self) -> bool:
        """Earlier entries of this run recorded operations (this entry continues them)."""
        return bool(self._recorded)

    async def load(self) -> None:
        """What earlier entries of the run recorded: calls to match, approvals asked for."""
        self._prior = {}
        for op in await self.ledger.backend.operations(self.run.id):
            self._recorded.add(op.id)
            self._prior.setdefault((op.tool, op.args_digest), []).append(op.id)
        self._approvals = {a.scope for a in await self.ledger.backend.approvals(self.run.id)}

    def key_for(self, tool: str, key: str | None, args: Any) -> str | None:
        """The operation key of a call: its own, or that of the recorded call it repeats."""
        if key is None or self._prior is None:
            return key
        op_id = f"{self.run.id}/{key}"
        try:  # the digest the gate records: equal arguments compare equal
            arguments = args_digest(args)
        except UnstableValue:  # not comparable (the gate records it apart): its own key
            return key
        same = self._prior.setdefault((tool, arguments), [])
        if op_id in self._recorded:  # the call itself, replayed under its id
            if op_id in same:
                same.remove(op_id)
            return key
        if same:  # a recorded call, asked for again under a new id
            return same.pop(0).removeprefix(f"{self.run.id}/")
        return key

    async def suspend(self, keys: Collection[str], reason: str) -> list[ApprovalRecord]:
        """The framework waits for approvals of the calls ``keys``: ask, and pause the run."""
        asked = [
            await self.run.request_approval(key, approver=self.approver or self.run.owner)
            for key in keys
        ]
        self._approvals.update(approval.scope for approval in asked)
        await self.run.suspend(reason)
        return asked

    async def decisions(self, keys: Collection[str]) -> dict[str, bool]:
        """The recorded decision on each of ``keys`` that has one (granted or denied)."""
        decided: dict[str, bool] = {}
        for approval in await self.ledger.backend.approvals(self.run.id):
            key = approval.scope.removeprefix(f"{self.run.id}/")
            if key in keys and approval.status in (ApprovalStatus.GRANTED, ApprovalStatus.DENIED):
                decided[key] = approval.status is ApprovalStatus.GRANTED
        return decided


_CURRENT: contextvars.ContextVar[Bound | None] = contextvars.ContextVar(
    "stopline_framework_run", default=None
)


@contextlib.contextmanager
def bind(bound: Bound) -> Iterator[Bound]:
    """Framework tools called in this context pass the gate of ``bound.run``."""
    token = _CURRENT.set(bound)
    try:
        yield bound
    finally:
        _CURRENT.reset(token)


def current() -> Bound:
    bound = _CURRENT.get()
    if bound is None:
        raise NoRun("a stopline-gated tool was called outside a stopline run")
    return bound


@dataclasses.dataclass(frozen=True, slots=True)
class ToolSpec:
    """What a wrapped framework tool declares to stopline."""

    effects: bool = True
    cancellable: Cancellable = Cancellable.NEVER
    verify: Verifier | None = None  # a read-back of the destination (``as_verifier``)
    cancel: CancelFn | None = None  # a cancel request to the provider (``Tool.canceller``)
    description: str = ""
    # R13: how long after dispatch the effect may still land (``Tool.settles_within``)
    settles_within: float | None = None

    def declare(self, tool: Tool[Any]) -> Tool[Any]:
        """Give an async ``tool`` this spec's read-back, canceller (both take the call's
        context, as everywhere: ``ctx.key`` is the idempotency key) and horizon."""
        if self.verify is not None:
            tool.verifier(self.verify)
        if self.cancel is not None:
            tool.canceller(self.cancel)
        if self.settles_within is not None:
            tool.settles_within = self.settles_within
        return tool


async def gated_call(
    tool: Tool[Any],
    *args: Any,
    key: str | None,
    needs_approval: bool = False,
    unkept_as_text: bool = True,
    **kwargs: Any,
) -> Any:
    """One call of ``tool`` through the gate of the current run, under ``key`` (or that
    of the call it repeats: recorded, ``Bound.key_for``; in doubt, ``open_calls``).

    A replayed call whose result was not kept answers with ``unkept_note`` (a
    tool's answer for the model), or raises ``NotReplayable`` (``unkept_as_text=False``:
    a node's state update cannot be a sentence)."""
    bound = current()
    async with open_calls(bound).calling(tool.name, key, [args, kwargs]) as key:
        # a call the run was paused for passes only with its approval granted
        asked = needs_approval or (key is not None and f"{bound.run.id}/{key}" in bound._approvals)
        try:
            async with bound.calls.one_at_a_time(key, tool.name):  # an id reused at once waits
                answer = bound.run.call(tool, *args, key=key, needs_approval=asked, **kwargs)
                return await told(bound, key, answer) if unkept_as_text else await answer
        except (IdempotencyConflict, NotReplayable) as refused:
            if isinstance(refused, NotReplayable) and not unkept_as_text:
                raise
            return refused_replay(refused, key, tool.name)


@contextlib.asynccontextmanager
async def open_run(
    ledger: Ledger,
    make: Callable[[Bound], Any],
    *,
    name: str,
    owner: str,
    run_id: str | None,
    tenant: str,
    policy: Policy,
    approver: str | None = None,
) -> AsyncIterator[Any]:
    """``ledger.run(...)`` bound to framework tools, as the session ``make(bound)`` builds.

    A paused run (waiting for an approval) is not entered: it would wait at the
    gate for ever. ``ledger.resume`` it first.
    """
    if run_id is not None:
        with contextlib.suppress(NotFound):
            state = (await ledger.backend.get_run(run_id)).state
            if state in (RunState.PAUSED, RunState.PAUSING):
                raise RunPaused(run_id)
    async with ledger.run(name, owner=owner, tenant=tenant, run_id=run_id, policy=policy) as r:
        bound = Bound(ledger, r, approver=approver or owner)
        await bound.load()
        session = bound.session = make(bound)
        with bind(bound):
            try:
                yield session
            finally:  # a cancel of the framework's own is on record before the run ends
                if bound.leaving is not None:
                    await bound.leaving()
                await bound.native_committed()


def mcp_offered(
    conn: StoplineMCP, include: Collection[str] | None, exclude: Collection[str]
) -> list[tuple[str, str, dict[str, Any]]]:
    """The tools of ``conn`` a model is offered, as ``(name, description, input schema)``:
    those of ``include`` (all when None) but ``exclude`` and ``stopline_verify`` (the
    read-back is stopline's, not the model's)."""
    from stopline.integrations.mcp import VERIFY_TOOL  # the extra is needed only here

    skip = {VERIFY_TOOL, *exclude}
    return [
        (name, listed.description or listed.title or name, listed.input_schema)
        for name, listed in conn.listing.items()
        if name not in skip and (include is None or name in include)
    ]


async def mcp_call(
    conn: StoplineMCP,
    name: str,
    arguments: dict[str, Any],
    *,
    key: str | None,
    idle_timeout: float | None = None,
) -> Any:
    """``conn.call(run, name, arguments, key=key)`` in the current run, beside the framework.

    The call runs in the ledger's task group; the framework's task only waits for
    it. When the framework stops waiting (its own cancel), the call goes on under
    stopline's cancel: the provider is asked and answers (``verify``), or, under an
    ``immediate`` policy, the call is cut and verified. Either way the operation
    records what the server did.
    """
    bound = current()
    run, ledger = bound.run, bound.ledger
    # the key of the recorded call it repeats, as ``conn.call`` digests its arguments
    key = bound.key_for(conn.tool(name).name, key, [(arguments,), {}])
    done = anyio.Event()
    outcome: list[tuple[bool, Any]] = []

    async def follow_cancel(scope: anyio.CancelScope) -> None:
        while not (run.cancel_requested and run.policy is Policy.IMMEDIATE):
            await ledger.wait_for_change(run.id)
        scope.cancel()  # an immediate cancel cuts the call (R3: unknown, then verified)

    async def work() -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(follow_cancel, tg.cancel_scope)
                try:
                    result = await conn.call(
                        run, name, arguments, key=key, idle_timeout=idle_timeout
                    )
                    outcome.append((True, result))
                except (Exception, RunFenced) as exc:  # handed to the framework's task
                    outcome.append((False, exc))
                tg.cancel_scope.cancel()
        finally:
            release()  # the call is over, not only its waiting: the next of its id may go
            done.set()

    release = await bound.calls.take(key, name)  # an id reused at once waits (ADR 0068)
    with inside(key):
        ledger.spawn(work)
    await done.wait()
    if not outcome:  # the ledger closed under it: what the server did is in the record
        raise RunFenced(run.id)
    ok, value = outcome[0]
    if isinstance(value, IdempotencyConflict | NotReplayable):
        return refused_replay(value, key, name)
    if not ok:
        raise value
    return value


def stopline_tool(fn: Callable[..., Any] | Tool[Any], name: str, spec: ToolSpec) -> Tool[Any]:
    """A ``stopline.Tool`` for a framework tool's function, sync or async.

    An async function is called directly (a cancel interrupts it; the outcome is
    ``unknown`` until verified). A sync one runs in an owned thread (``_detached``).
    A ``stopline.Tool`` is used as it is.
    """
    if isinstance(fn, Tool):
        return fn
    takes_ctx = wants_context(fn)
    if not spec.effects:
        return _read_tool(fn, name, spec, takes_ctx)
    if inspect.iscoroutinefunction(fn):

        async def call(ctx: CallContext, *args: Any, **kwargs: Any) -> Any:
            return await (fn(ctx, *args, **kwargs) if takes_ctx else fn(*args, **kwargs))

        tool: Tool[Any] = Tool(
            call,
            name=name,
            description=spec.description or name.replace("_", " "),
            effects=spec.effects,
            cancellable=spec.cancellable,
        )
        tool.wants_context = spec.effects
        return spec.declare(tool)
    sync_fn = fn

    def in_thread(ctx: CallContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        return _threaded(sync_fn, (ctx, *args) if takes_ctx else args, kwargs)

    return detached_tool(name, spec, in_thread)


def _read_tool(fn: Callable[..., Any], name: str, spec: ToolSpec, takes_ctx: bool) -> Tool[Any]:
    """A framework tool declared without effects: nothing is recorded for its call, so
    it has no call context (its arguments are the model's alone; a read given a context
    took the model's first argument for it, and every call failed). It runs while it is
    awaited: a ``def`` in a worker thread, its context variables copied."""
    if takes_ctx:
        raise InvalidInput(
            "tool",
            f"{name!r} is declared without effects: nothing is recorded for its calls, so "
            "it has no call context; drop its ctx parameter, or declare its effects",
        )
    if inspect.iscoroutinefunction(fn):
        body: Callable[..., Awaitable[Any]] = fn
    else:

        async def body(*args: Any, **kwargs: Any) -> Any:
            return await _threaded(fn, args, kwargs)()

    description = spec.description or name.replace("_", " ")
    return Tool(body, name=name, description=description, effects=False)


def _threaded(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
    """``fn(*args, **kwargs)`` as work for a worker thread, with the caller's context
    variables (copied now, where the call is made)."""
    run = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return lambda: anyio.to_thread.run_sync(run)
