"""Helpers for ``MCPServer`` tool authors: truthful effects behind an MCP tool.

    effects = Effects("effects.db")
    server = MCPServer("payments")
    effects.install(server)        # the stopline_verify tool + the cancellation log

    @server.tool(meta=effect_meta(Cancellable.UNTIL_ACCEPTED))
    async def charge(amount: int, ctx: Context) -> dict[str, Any]:
        async with effects.operation(ctx, "charge", Cancellable.UNTIL_ACCEPTED) as op:
            if op.replayed:                # the same key again: the recorded result,
                return op.result           # never a second effect
            await op.accepted()            # tells the client; from here on the cancel is refused
            return await op.commit(bank.charge, amount)   # shielded, recorded before returning

What each piece promises:

- **Idempotency by key.** The client sends the operation id in the request's
  ``_meta["io.stopline/key"]``. A key that committed returns its recorded
  result; a key whose attempt is still running is waited for; a key in doubt
  (a commit interrupted by a crash) is refused with an error, never re-run.
- **Durable commit before the answer.** ``commit`` records ``committing``,
  runs the effect in a shielded scope, records ``committed`` with the result,
  and only then returns: a result that is never sent (the client cancelled,
  the stream broke) is still provable through ``stopline_verify``.
- **Honest cancellation.** An async tool cancelled before its commit records
  ``not_committed`` with the state it was in. Inside ``commit`` (and after
  ``accepted`` for tools that cannot cancel once accepted) the cancel is
  refused: the work finishes and its outcome is recorded. A plain ``def`` tool
  runs in a worker thread and cannot be interrupted at all: wrap its effect in
  ``effects.run_sync(ctx, "tool", fn, ...)`` so its commit is recorded the same
  way, and declare it ``Cancellable.NEVER``.
- **What the record can tell.** ``stopline_verify`` says "not committed" of a key it
  has no record of only for a tool declared ``io.stopline/tracked`` (``effect_meta``
  declares it): a tool that records nothing through ``Effects`` may have run and left
  no trace, so for it the answer is ``unknown`` (``_verdicts``, ADR 0063). So is the
  key of a tracked tool's call whose body may have run and recorded nothing (it failed
  before ``effects.operation``, was cancelled, its process died; ``_tracking``, 0067).
- **A cancellation log.** Every cancel the server sees (a
  ``notifications/cancelled``, a handler interrupted by a stream close) is
  written to the ``stopline_cancellations`` table with the request id, the
  key, the tool, the time and the operation's state at that moment.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS, ToolAnnotations
from opentelemetry import trace

from mcp import MCPError
from stopline.domain.limits import check_id
from stopline.domain.vocab import Cancellable
from stopline.errors import InvalidInput, describe
from stopline.integrations.mcp._store import EffectRecord, EffectState, EffectStore
from stopline.integrations.mcp._tracking import (
    Tracking,
    peer_of,
    rejected,
    this_call,
    usable_key,
)
from stopline.integrations.mcp._verdicts import answer, pending_detail
from stopline.integrations.mcp._vocab import (
    ACCEPTED_MESSAGE,
    CANCELLABLE_META,
    EFFECTS_META,
    KEY_META,
    OUTCOME_DATA,
    TRACKED_META,
    VERIFY_TOOL,
    check_verify_wait,
)
from stopline.runtime.tool import Rejected
from stopline.telemetry import ATTR_OP_ID

__all__ = ["Effects", "Operation", "effect_meta", "key_of"]

_POLL = 0.05  # s between reads of an attempt another process holds

T = TypeVar("T")


def effect_meta(
    cancellable: Cancellable = Cancellable.UNTIL_ACCEPTED, *, tracked: bool = True
) -> dict[str, Any]:
    """The tool ``_meta`` a stopline client reads: the tool has effects, and how it cancels.

    ``tracked`` (the default) promises that the tool records every call through
    ``effects.operation`` or ``effects.run_sync``: only then does ``stopline_verify``'s
    "no record of the key" prove "not committed". Pass ``tracked=False`` for a tool that
    does not (ADR 0063)."""
    meta: dict[str, Any] = {EFFECTS_META: True, CANCELLABLE_META: cancellable.value}
    if tracked:
        meta[TRACKED_META] = True
    return meta


def key_of(ctx: Context[Any]) -> str:
    """The idempotency key of this request (``_meta["io.stopline/key"]``), a usable id
    (``check_id``); else the request is refused before any effect."""
    meta = ctx.request_context.meta or {}
    key = usable_key(cast(dict[str, Any], meta).get(KEY_META))
    if key is None:
        raise rejected(
            f"this tool needs an idempotency key in _meta[{KEY_META!r}]"
            " (a string of 1 to 1024 characters, no control characters)"
        )
    return key


@dataclasses.dataclass
class _Live:
    """What this process knows of an attempt in progress (mirrors the durable state)."""

    state: EffectState
    settled: anyio.Event
    shielded: bool = False
    news: anyio.Event = dataclasses.field(default_factory=anyio.Event)  # the next thing told

    def tell(self) -> None:
        """Wake its long polls: its outcome recorded, a cancel refused, or its end."""
        news, self.news = self.news, anyio.Event()
        news.set()


class Effects:
    """The server's durable record of effects by key, its verify tool and its cancel log."""

    def __init__(self, path: str | Path) -> None:
        self.store = EffectStore(path)
        self.recovered = self.store.recover()
        self._live: dict[str, _Live] = {}
        self._arriving: collections.Counter[str] = collections.Counter()
        # (peer, request id) -> (key, tool): a request id names a request of one peer only
        self._requests: dict[tuple[str, str], tuple[str | None, str | None]] = {}
        self.tracking = Tracking(self.store)  # whose calls the record holds (ADR 0063, 0067)

    def install(self, server: MCPServer[Any]) -> None:
        """Add the ``stopline_verify`` tool and the cancellation-log middleware, and follow
        how the server's tool calls end (``_tracking``). Once per record: again on the same
        server does nothing; on another, ``InvalidInput``."""
        if self.tracking.server is server:
            return
        self.tracking.hook(server)

        async def stopline_verify(
            key: str, tool: str | None = None, wait_seconds: float = 0.0
        ) -> dict[str, Any]:
            """Read-only: what happened to the operation with this idempotency key.

            ``tool`` names the tool the key was sent to: no record of the key proves
            "not committed" only for a tool this server records every call of
            (``tracked`` in the answer). ``wait_seconds`` (0 to 30) waits for an
            attempt in progress to end.
            """
            try:
                check_id("key", key)  # a key no call can carry (``key_of`` refuses it)
                return await self.status(key, tool=tool, wait_seconds=wait_seconds)
            except InvalidInput as exc:  # typed, naming the problem; nothing read
                raise MCPError(code=INVALID_PARAMS, message=str(exc)) from exc

        server.add_tool(
            stopline_verify,
            name=VERIFY_TOOL,
            annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True),
            meta={EFFECTS_META: False},
        )
        server.middleware.append(self.middleware)

    def operation(
        self,
        ctx: Context[Any],
        tool: str,
        cancellable: Cancellable = Cancellable.UNTIL_ACCEPTED,
    ) -> Operation:
        """``async with effects.operation(ctx, "tool") as op``: one keyed effect."""
        return Operation(self, ctx, key_of(ctx), tool, cancellable)

    # -- reads ---------------------------------------------------------------------
    async def status(
        self, key: str, *, tool: str | None = None, wait_seconds: float = 0.0
    ) -> dict[str, Any]:
        """The ``stopline_verify`` answer for ``key`` sent to ``tool`` (``_verdicts``);
        ``wait_seconds`` outside 0 to 30 is ``InvalidInput``."""
        wait = check_verify_wait(wait_seconds)
        if wait > 0:  # a long poll
            with anyio.move_on_after(wait):
                await self._until_ended(key)
        seen = await anyio.to_thread.run_sync(self.store.evidence, key)
        in_flight = key in self._live or self._arriving[key] > 0 or seen.arriving
        why = await self.tracking.why_untracked(tool)
        return answer(
            key,
            seen.record,
            in_flight=in_flight,
            tool=tool,
            why_untracked=why,
            unrecorded=seen.unrecorded,
        )

    async def _until_ended(self, key: str) -> None:
        """Until the attempt with ``key`` records its outcome, refuses a cancel or ends:
        awaited when it runs here (one held after its commit is "committed" already, one
        that refused a cancel is told so at once); read again each
        ``_POLL`` s while it is arriving here or another process on the file holds it or
        has it on its way (its end is seen only in the file), so a client's long poll is
        not a busy loop."""
        while True:
            live = self._live.get(key)
            if live is not None:
                if live.state is not EffectState.COMMITTED:  # else answered already
                    await live.news.wait()
                return
            seen = await anyio.to_thread.run_sync(self.store.evidence, key)
            record = seen.record
            if record is None and self._arriving[key] <= 0 and not seen.arriving:
                return  # no call has it on its way
            if record is not None and record.state.terminal:
                return
            await anyio.sleep(_POLL)

    async def cancellations(self) -> list[dict[str, Any]]:
        """The cancellation log, oldest first."""
        return await anyio.to_thread.run_sync(self.store.cancellations)

    # -- sync tools ------------------------------------------------------------------
    def run_sync(self, ctx: Context[Any], tool: str, fn: Callable[..., T], *args: Any) -> T:
        """Inside a ``def`` tool (a worker thread): run ``fn`` as a keyed, recorded commit.

        The thread cannot be interrupted, so a cancel never stops it: the commit
        happens and is recorded, and ``stopline_verify`` reports it.
        """
        key = key_of(ctx)
        live = anyio.from_thread.run_sync(self._open_live, key)
        try:
            call = this_call(key)
            record, fresh = self.store.begin(key, tool, call.arrival if call else None)
            if call is not None:
                call.began()
            if not fresh:
                return cast(T, _replay_or_refuse(record))
            self.store.set_state(key, EffectState.COMMITTING)
            live.state = EffectState.COMMITTING
            try:
                result = fn(*args)
            except Rejected as exc:
                self.store.set_state(key, EffectState.NOT_COMMITTED, detail=exc.reason)
                raise rejected(exc.reason) from exc
            except Exception as exc:
                detail = describe(exc)
                self.store.set_state(key, EffectState.UNKNOWN, detail=detail)
                raise _in_doubt(f"the commit failed part-way: {exc}") from exc
            except BaseException as exc:
                self.store.set_state(key, EffectState.UNKNOWN, detail=repr(exc))
                raise
            try:
                self.store.set_state(key, EffectState.COMMITTED, result=result)
            except Exception as exc:
                detail = _unrecorded(exc)
                with contextlib.suppress(Exception):
                    self.store.set_state(key, EffectState.UNKNOWN, detail=detail)
                raise _in_doubt(detail) from exc
            return result
        finally:
            anyio.from_thread.run_sync(self._close_live, key, live)

    def _open_live(self, key: str) -> _Live:
        live = self._live[key] = _Live(EffectState.RECEIVED, anyio.Event(), shielded=True)
        return live

    def _close_live(self, key: str, live: _Live) -> None:
        if self._live.get(key) is live:
            del self._live[key]
        live.tell()
        live.settled.set()

    # -- cancellation log --------------------------------------------------------------
    async def middleware(
        self, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        """Records every cancel this server sees, with the operation's state at that moment."""
        params = cast(dict[str, Any], ctx.params or {})
        if ctx.method == "notifications/cancelled":
            rid = str(params.get("requestId"))
            reason = str(params.get("reason") or "")
            await self._note_cancel(rid, "notification", reason, peer=peer_of(ctx))
            return await call_next(ctx)
        if ctx.method != "tools/call" or ctx.request_id is None:
            return await call_next(ctx)
        meta = cast(dict[str, Any], ctx.meta or {})
        key, name = usable_key(meta.get(KEY_META)), params.get("name")
        rid, peer = str(ctx.request_id), peer_of(ctx)
        self._requests[peer, rid] = (key, name)
        if key:  # registered before any await: a verify sent after this request sees it
            trace.get_current_span().set_attribute(ATTR_OP_ID, key)  # the SDK's server span
            self._arriving[key] += 1
        try:
            return await call_next(ctx)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._note_cancel(rid, "handler_cancelled", "", peer=peer)
            raise
        finally:
            self._requests.pop((peer, rid), None)
            if key:
                self._arriving[key] -= 1
                if self._arriving[key] <= 0:
                    del self._arriving[key]

    async def cancel_ignored(self, request_id: str, reason: str = "") -> None:
        """For stdio servers that drop ``notifications/cancelled``: log it as a refused cancel."""
        await self._note_cancel(request_id, "ignored", reason, peer="", refused=True)

    async def _note_cancel(
        self, rid: str, via: str, reason: str, *, peer: str, refused: bool = False
    ) -> None:
        key, tool = self._requests.get((peer, rid), (None, None))
        live = self._live.get(key) if key else None
        if live is not None:
            state = live.state.value
        elif key:
            record = await anyio.to_thread.run_sync(self.store.get, key)
            state = record.state.value if record else "not_started"
        else:
            state = "finished_or_unknown"
        await anyio.to_thread.run_sync(self.store.log_cancel, rid, key, tool, via, state, reason)
        if key and live is not None and (refused or live.shielded):
            await anyio.to_thread.run_sync(self.store.set_cancel, key, "refused")
            live.tell()  # a long poll of it hears the refusal now, not at its end


class Operation:
    """One keyed effect inside an async tool; see ``Effects.operation``."""

    def __init__(
        self, effects: Effects, ctx: Context[Any], key: str, tool: str, cancellable: Cancellable
    ) -> None:
        self._effects = effects
        self._ctx = ctx
        self.key = key
        self.tool = tool
        self.cancellable = cancellable
        self.replayed = False
        self.result: Any = None
        self._live: _Live | None = None
        self._shield: anyio.CancelScope | None = None
        self._done = False

    async def __aenter__(self) -> Operation:
        effects = self._effects
        while (other := effects._live.get(self.key)) is not None:
            await other.settled.wait()  # the same key already running here: wait for it
        self._live = effects._live[self.key] = _Live(EffectState.RECEIVED, anyio.Event())
        call = this_call(self.key)
        arrival = call.arrival if call else None
        try:  # a cancel at the thread's first checkpoint left the key live for good
            with anyio.CancelScope(shield=True):  # begun, ``__aexit__`` settles it
                record, fresh = await anyio.to_thread.run_sync(
                    effects.store.begin, self.key, self.tool, arrival
                )
        except BaseException:
            self._settle()  # not begun (the record could not be written): not live
            raise
        if call is not None:
            call.began()
        if not fresh:
            self._settle()
            self.replayed, self.result = True, _replay_or_refuse(record)
            self._done = True
            return self
        if self.cancellable is Cancellable.NEVER:
            self._enter_shield()
        return self

    async def accepted(self) -> None:
        """Acknowledge the request to the client (a progress notification) and record it."""
        await self._set(EffectState.ACCEPTED)
        await self._ctx.report_progress(0, None, ACCEPTED_MESSAGE)
        if self.cancellable is not Cancellable.AFTER_ACCEPTED:
            self._enter_shield()  # from here on a cancel is refused; the outcome is recorded

    async def commit(self, fn: Callable[..., Awaitable[T] | T], *args: Any) -> T:
        """Run the effect shielded from cancellation; record its outcome before returning."""
        with anyio.CancelScope(shield=True):
            await self._set(EffectState.COMMITTING)
            try:
                out = fn(*args)
                result = cast(T, await out if inspect.isawaitable(out) else out)
            except Rejected as exc:
                await self._set(EffectState.NOT_COMMITTED, detail=exc.reason)
                raise rejected(exc.reason) from exc
            except Exception as exc:
                await self._set(EffectState.UNKNOWN, detail=describe(exc))
                raise _in_doubt(f"the commit failed part-way: {exc}") from exc
            await self._set(EffectState.COMMITTED, result=result)
        self._done = True
        return result

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        if self._shield is not None:
            self._shield.__exit__(None, None, None)
        try:
            if self._done or self._live is None or self._live.state.terminal:
                return
            with anyio.CancelScope(shield=True):
                if self._live.state is EffectState.COMMITTING:  # the effect may have happened
                    detail = _unrecorded(exc)
                    with contextlib.suppress(Exception):
                        await self._set(EffectState.UNKNOWN, detail=detail)
                    raise _in_doubt(detail) from exc
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    was = self._live.state.value
                    detail = f"cancelled while {was}; nothing committed"
                    await self._set(EffectState.NOT_COMMITTED, detail=detail)
                    store = self._effects.store
                    rid = str(self._ctx.request_id)
                    await anyio.to_thread.run_sync(
                        lambda: store.log_cancel(rid, self.key, self.tool, "tool_stopped", was, "")
                    )
                    await anyio.to_thread.run_sync(store.set_cancel, self.key, "stopped")
                    return
                reason = "the tool ended without committing"
                if isinstance(exc, Rejected):
                    reason = exc.reason
                elif exc is not None:
                    reason = describe(exc)
                await self._set(EffectState.NOT_COMMITTED, detail=reason)
            if isinstance(exc, MCPError) or exc is None:
                return
            raise rejected(reason) from exc
        finally:
            self._settle()

    def refuse_cancel(self) -> None:
        """From here on a cancel is refused: the work goes on and its outcome is recorded.

        Call it at the top level of the ``async with`` block (it opens a shielded
        scope that closes when the block ends).
        """
        self._enter_shield()

    def _enter_shield(self) -> None:
        if self._shield is None:
            self._shield = anyio.CancelScope(shield=True)
            self._shield.__enter__()
            assert self._live is not None
            self._live.shielded = True

    async def _set(self, state: EffectState, *, result: Any = None, detail: str = "") -> None:
        assert self._live is not None
        store = self._effects.store
        await anyio.to_thread.run_sync(
            lambda: store.set_state(self.key, state, result=result, detail=detail)
        )
        self._live.state = state
        if state is EffectState.COMMITTED:  # nothing more is recorded of it (the ends of
            self._live.tell()  # other outcomes write more: ``_settle`` tells)

    def _settle(self) -> None:
        live = self._live
        if live is not None and self._effects._live.get(self.key) is live:
            del self._effects._live[self.key]
            live.tell()
            live.settled.set()


def _replay_or_refuse(record: EffectRecord) -> Any:
    if record.state is EffectState.COMMITTED:
        return record.result
    raise _in_doubt(
        f"operation {record.key!r} is {record.state.value} ({pending_detail(record)});"
        " it is not run again"
    )


def _unrecorded(exc: BaseException | None) -> str:
    """Once ``committing`` is recorded the effect may have happened: what failed after
    it makes the outcome ``unknown``, never ``not_committed``."""
    cause = describe(exc) if exc is not None else "the tool ended"
    return f"the commit ran; its outcome could not be recorded ({cause})"


def _in_doubt(message: str) -> MCPError:
    return MCPError(code=INTERNAL_ERROR, message=message, data={OUTCOME_DATA: "unknown"})
