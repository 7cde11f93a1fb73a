"""Framework tool calls whose work runs to its end whoever stops waiting (``detached_tool``).

Frameworks run a ``def`` tool in a worker thread and forget it when they cancel
the awaiting task: the thread goes on and commits, and nobody records it. Here
the work is started from the ledger's own task group; when the awaiting scope
is cancelled the operation is recorded ``unknown`` (R3), and the work's
eventual answer is attached with ``ledger.late_response`` (R4). Its verifier
is the work itself: it waits for the answer.

An adapter makes such a tool for each call (or each agent) of one framework tool,
and the ledger keeps the first of a name (``Core.register_tool``): the calls in
flight are the ledger's (``_in_flight``), so any tool made from one declaration
reads back any of its calls, and two are equal (one declaration, ADR 0086) when
they fall back on the same read-back.

Whatever the work raises is its call's own answer, a ``BaseException`` too
(``SystemExit``, ``KeyboardInterrupt``): it is handed to the awaiting caller
(the gate records it as it records an async tool's), never to the ledger's
task group, where it would cancel other runs' work (STYLE 16). An entry is
kept only until what it proves is delivered or recorded.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio

from stopline.domain.vocab import Cancellable
from stopline.runtime.context import CallContext
from stopline.runtime.tool import ReadBack, Rejected, Tool, Verdict, Verifier, same_function

if TYPE_CHECKING:
    from stopline.integrations._frameworks import ToolSpec
    from stopline.runtime.core import Core

__all__ = ["Work", "detached_tool"]

Work = Callable[[], Awaitable[Any]]


def detached_tool(
    name: str,
    spec: ToolSpec,
    start: Callable[[CallContext, tuple[Any, ...], dict[str, Any]], Work],
) -> Tool[Any]:
    """A tool whose work runs to its end in the ledger's task group, whoever stops waiting.

    ``start(ctx, args, kwargs)`` returns the work (a thread, a framework's own
    executor call). A cancelled caller records ``unknown``; the work's answer is
    attached when it comes (R4). The verifier waits for that answer.
    """
    detached = _Detached(start, spec.verify)
    tool: Tool[Any] = Tool(
        detached.call,
        name=name,
        description=spec.description or name.replace("_", " "),
        effects=spec.effects,
        cancellable=Cancellable.NEVER,  # it cannot be interrupted: say so (R12)
    )
    tool.wants_context = spec.effects
    tool.verify_fn = detached.verify
    tool.settles_within = spec.settles_within
    return tool


class _Outcome:
    """One call of a sync function in its worker thread."""

    def __init__(self) -> None:
        self.done = anyio.Event()  # the function returned or raised
        self.settled = anyio.Event()  # ... and what it proves is recorded
        self.abandoned = False  # the awaiting scope was cancelled first
        self.result: Any = None
        # what the work raised, whatever it is: the call's own answer (SystemExit too)
        self.error: BaseException | None = None


# the calls of a ledger's detached tools whose answer is not yet delivered to their
# caller nor recorded late, by operation key: the ledger's, not one tool's, as the
# ledger reads an operation back with the first tool of its name
_IN_FLIGHT: weakref.WeakKeyDictionary[Core, dict[str, _Outcome]] = weakref.WeakKeyDictionary()


def _in_flight(core: Core) -> dict[str, _Outcome]:
    return _IN_FLIGHT.setdefault(core, {})


class _Detached:
    """Calls that finish, and are recorded, whoever stops waiting for them."""

    def __init__(
        self,
        start: Callable[[CallContext, tuple[Any, ...], dict[str, Any]], Work],
        verify: Verifier | None,
    ) -> None:
        self.start = start
        self.user_verify = verify

    def __eq__(self, other: object) -> bool:
        """One declaration: each reads back every call in flight (the ledger's), and
        falls back on the same read-back (``same_function``)."""
        if not isinstance(other, _Detached):
            return NotImplemented
        return same_function(self.user_verify, other.user_verify)

    def __hash__(self) -> int:
        return hash(_Detached)  # equal ones are made again from one declaration

    async def call(self, ctx: CallContext, *args: Any, **kwargs: Any) -> Any:
        core = ctx.core
        outcome = _in_flight(core)[ctx.key] = _Outcome()
        work = self.start(ctx, args, kwargs)
        core.spawn(self._work, core, ctx, outcome, work)
        try:
            await outcome.done.wait()
        except anyio.get_cancelled_exc_class():
            # the framework stopped waiting: the thread goes on; its answer is kept (R4)
            outcome.abandoned = True
            if outcome.done.is_set():
                core.spawn(self._report, core, ctx.key, outcome)
            raise
        # delivered: the gate records it from here; nothing more to hold
        _forget(core, ctx.key, outcome)
        outcome.settled.set()
        if outcome.error is not None:
            raise outcome.error
        return outcome.result

    async def _work(self, core: Core, ctx: CallContext, outcome: _Outcome, work: Work) -> None:
        with anyio.CancelScope(shield=True):  # closing the ledger waits for the work
            try:  # an awaitable is no answer, given in time or late (ADR 0089)
                outcome.result = ctx.tool.answer(await work())
            except BaseException as exc:  # the call's answer, for its caller, never this group's
                outcome.error = exc
            outcome.done.set()
            if outcome.abandoned:
                await self._report(core, ctx.key, outcome)

    async def _report(self, core: Core, key: str, outcome: _Outcome) -> None:
        """Attach the late answer to its operation: committed, refused, or kept only."""
        outcomes = core.outcomes
        try:
            if outcome.error is None:
                await outcomes.late_response(
                    key, Verdict.COMMITTED, result=outcome.result, detail="late: worker thread"
                )
            elif isinstance(outcome.error, Rejected):
                await outcomes.late_response(
                    key, Verdict.NOT_COMMITTED, ref=outcome.error.ref, detail=outcome.error.reason
                )
            else:
                detail = f"late: {type(outcome.error).__name__}: {outcome.error}"
                await outcomes.late_response(key, Verdict.UNKNOWN, detail=detail)
        finally:
            _forget(core, key, outcome)  # recorded: a verifier waiting now holds it already
            outcome.settled.set()

    async def verify(self, ctx: CallContext) -> ReadBack | Verdict:
        """The thread is this process's ground truth: wait for it to answer."""
        outcome = _in_flight(ctx.core).get(ctx.key)
        if outcome is None:  # not run here (before a restart), or its answer is recorded
            if self.user_verify is not None:
                return await self.user_verify(ctx)
            detail = "not run in this process, or its answer is recorded"
            return ReadBack(Verdict.UNKNOWN, detail=detail)
        await outcome.settled.wait()
        if outcome.error is None:
            return ReadBack(
                Verdict.COMMITTED, "worker-thread", "the function returned", outcome.result
            )
        if isinstance(outcome.error, Rejected):
            return ReadBack(Verdict.NOT_COMMITTED, outcome.error.ref, outcome.error.reason)
        if self.user_verify is not None:
            return await self.user_verify(ctx)
        return ReadBack(Verdict.UNKNOWN, detail=f"{type(outcome.error).__name__}")


def _forget(core: Core, key: str, outcome: _Outcome) -> None:
    calls = _in_flight(core)
    if calls.get(key) is outcome:
        del calls[key]
