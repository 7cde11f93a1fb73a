"""The client wrapper: every side-effecting MCP tool call is a stopline operation.

    async with StoplineMCP(StdioServerParameters(...), mode="legacy") as mcp:
        async with ledger.run("refund", owner="user:42") as run:
            receipt = await mcp.call(run, "refund", {"order": 7})

``mcp.call`` (or ``run.call(await mcp.tool("refund"), {...})``) passes the
dispatch gate before the request is written, sends the operation id as the
idempotency key in ``_meta["io.stopline/key"]`` (and, when a tool's policy
names a ``key_argument``, in the arguments too) and records what the answer
proves (see ``_call``). Around it:

- a ``LateResponseTap`` on the transport attaches answers that arrive after
  a cancel or a timeout to their operation (``ledger.late_response``, R4);
- progress notifications become progress events; the server's acceptance
  notification records ``accepted``;
- the server's tool listing says which tools have effects and how they
  cancel (``_meta["io.stopline/effects"]``, ``["io.stopline/cancellable"]``;
  ``readOnlyHint`` only with ``trust_read_hints=True``, ADR 0055), and
  ``policies={name: ToolPolicy(...)}`` overrides it;
- a cancel of the run reaches every call in flight (issue 20): the SDK sends
  ``notifications/cancelled`` (stdio, 2025-era HTTP) or closes the request's
  stream (2026 HTTP), a task's call sends ``tasks/cancel`` (``tasks_client``,
  each channel recorded); the call stays tracked (late answers are kept, R4) and
  its outcome comes from a read-back after its horizon (R13: the tool's
  ``settles_within``, else the call's progress cap), unless its policy says
  the server cannot cancel (``cancellable=never``: never asked);
- ``stopline_verify``, when offered, is every tool's read-back (else ``verifiers=``);
- a connection that ends ends its calls in flight at once (``unknown``,
  transport; a stdio server's output that ends drops it at once, in flight or
  not: ``_client_transport``) and is re-opened on next use by ``_keep``, with capped backoff
  and jitter; a wait for it is bounded by the call's deadline (at most
  ``connect_timeout``): an effectful call that never got one was not sent.
  A Streamable HTTP session the server no longer has (404) is one that ended
  (``_http``); a tool listed twice, or listed again after a change notice,
  keeps its most conservative declaration (``_listing``, ``_tools``, ADR 0062).
"""

from __future__ import annotations

import collections
import contextvars
import functools
import logging
import math
from collections.abc import Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus
from mcp.client import ClientExtension
from mcp_types import Tool as McpTool
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from mcp import Client, StdioServerParameters
from stopline.domain.limits import check_seconds
from stopline.domain.model import CancelState
from stopline.domain.vocab import Cause
from stopline.errors import UnknownTool, describe
from stopline.integrations._renamed import renamed_idle_timeout
from stopline.integrations._verify import through
from stopline.integrations.mcp._call import (
    McpCall,
    cancel_channel,
    never_processed,
    payload_of,
    plain_result,
    read_tool,
    verify_status,
)
from stopline.integrations.mcp._client_transport import transport_for
from stopline.integrations.mcp._http import HttpRefusals
from stopline.integrations.mcp._listing import Listing, follow, list_all
from stopline.integrations.mcp._stdio import on_bad_bytes
from stopline.integrations.mcp._tools import declare, listed_check, routed
from stopline.integrations.mcp._vocab import KEY_META, VERIFY_TOOL, ToolPolicy, policy_from_listing
from stopline.integrations.mcp.opening import failed_opening, first_error
from stopline.integrations.mcp.tap import LateAnswer, LateResponseTap, classify_late
from stopline.integrations.mcp.tasks_client import CURRENT_CALL, TaskOutcome, TasksClient
from stopline.runtime.boundary import Backoff, span_quietly
from stopline.runtime.context import CallContext
from stopline.runtime.lifecycle import Retry
from stopline.runtime.outcomes import Outcomes
from stopline.runtime.provider_asks import CancelAnswer
from stopline.runtime.run import Run
from stopline.runtime.tool import NoAnswer, Rejected, Tool, Verdict, Verifier

__all__ = ["StoplineMCP", "UnknownTool"]

logger = logging.getLogger(__name__)

Target = StdioServerParameters | str


_IDLE: contextvars.ContextVar[float | None] = contextvars.ContextVar("stopline_mcp_idle")


class StoplineMCP:
    """One MCP connection whose side-effecting tool calls are stopline operations."""

    def __init__(
        self,
        target: Target,
        *,
        mode: str = "legacy",
        name: str | None = None,
        policies: Mapping[str, ToolPolicy] | None = None,
        verifiers: Mapping[str, Verifier] | None = None,
        progress_cap: float | None = 300.0,
        settle_timeout: float = 30.0,
        poll_wait: float = 5.0,
        extensions: Sequence[ClientExtension] = (),
        tasks: bool = False,
        tracer_provider: trace.TracerProvider | None = None,
        connect_timeout: float = 30.0,
        backoff: Backoff | None = None,
        trust_read_hints: bool = False,
        check_input_schemas: bool = True,
    ) -> None:
        waits = dict(progress_cap=progress_cap, settle_timeout=settle_timeout, poll_wait=poll_wait)
        for what, wait in {**waits, "connect_timeout": connect_timeout}.items():
            check_seconds(what, wait)  # here, not in a call after its gate
        self.target = target
        self.mode = mode
        self.name = name or "mcp"
        self.policies = dict(policies or {})
        self.verifiers = dict(verifiers or {})
        self.progress_cap = progress_cap  # no progress extends a call's wait past this
        self.settle_timeout = settle_timeout  # how long a cancelled call asks for the truth
        self.poll_wait = poll_wait  # the long poll of one stopline_verify
        self.extensions = list(extensions)
        self.tasks: TasksClient | None = None
        if tasks:  # MCP tasks: 2026 when the server decides, 2025 for policy.task tools
            self.tasks = TasksClient(spawn=self._spawn, on_final=self._task_final)
            self.extensions.append(self.tasks)
        # readOnlyHint makes a read only when trusted (ADR 0055); listed schemas: ``_tools``
        self.trust_read_hints, self.check_input_schemas = trust_read_hints, check_input_schemas
        self.tool_listing = Listing()  # the tools as listed, kept current (ADR 0062)
        self.late: list[LateAnswer] = []  # every late answer seen, for inspection
        self._tools: dict[str, Tool[Any]] = {}
        self._routes: dict[str, tuple[Any, Any]] = {}  # each tool's (invoke, read)
        self._calls: dict[str, McpCall] = {}
        # op ids whose request a cut told to stop after the call left ``_calls`` (R14)
        self._told: collections.OrderedDict[str, None] = collections.OrderedDict()
        # where each call's late answer is recorded (R4), by operation id
        self._outcomes: collections.OrderedDict[str, Outcomes] = collections.OrderedDict()
        self._client: Client | None = None
        # each HTTP connection's refused requests, which prove "not processed" (``_http``),
        # by id(client): a new client's entry replaces that of a freed one with its id
        self._refusals: collections.OrderedDict[int, HttpRefusals] = collections.OrderedDict()
        self._ready = anyio.Event()
        self._dead = anyio.Event()
        self._wanted = anyio.Event()
        self._closing = False
        self._tg: TaskGroup | None = None
        self.connections = 0  # how many times the transport was opened
        # the supervisor: re-opening waits by `backoff`, a caller at most `connect_timeout`
        self.connect_timeout = connect_timeout
        self.backoff = backoff or Backoff(first=0.1, cap=5.0)
        self.attempts = 0  # connection attempts, successful or not
        self.last_error = ""  # why the last connection ended or failed to open
        self.on_request: Callable[[str, Any], None] | None = None  # (key, JSON-RPC id) as sent
        self._tracer = trace.get_tracer("stopline.mcp", tracer_provider=tracer_provider)
        self._spans: dict[str, trace.Span] = {}  # op id -> its execute_tool span

    # -- lifecycle -------------------------------------------------------------------
    async def __aenter__(self) -> StoplineMCP:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._tg.start(self._keep)
        except BaseException:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._closing = True
        self._dead.set()
        self._wanted.set()
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()  # followers and late-answer attachments stop with us
            await tg.__aexit__(None, None, None)

    async def _keep(self, *, task_status: TaskStatus[None]) -> None:
        """Holds the SDK client open in one task; re-opens it on demand after a break.
        Attempts after a failure wait by ``backoff`` (capped, with jitter); a connection
        that stayed up longer than the cap starts the backoff afresh."""
        first = True
        delays = self.backoff.delays()
        while not self._closing:
            refusals = HttpRefusals()
            tap = LateResponseTap(
                transport_for(self.target, refusals),
                self._on_late,
                on_request=self._sent,
                on_cancel=self._told_stop,
                on_notice=self.tool_listing.on_notice,
            )
            client = Client(tap, mode=self.mode, extensions=self.extensions)
            refusals.on_session_gone = functools.partial(self.mark_broken, client)
            self._refusals[id(client)] = refusals
            while len(self._refusals) > 64:
                self._refusals.popitem(last=False)
            on_bad_bytes(functools.partial(self._lost, client))  # the stdio reader tells
            self.attempts += 1
            opened_at, ended = anyio.current_time(), "the connection was closed"
            # opening (the handshake and the listing) waits ``connect_timeout`` at most: a
            # server that accepts and never answers held it for ever
            opening = anyio.CancelScope(deadline=opened_at + self.connect_timeout)
            try:
                with opening:
                    async with client:
                        self.connections += 1
                        covers = self.tool_listing.notices
                        self._apply(await list_all(client), covers)
                        opening.deadline = math.inf
                        self._client, self._dead = client, anyio.Event()
                        self._wanted = anyio.Event()
                        self._ready.set()
                        if first:
                            first = False
                            task_status.started()
                        async with anyio.create_task_group() as changes:
                            changes.start_soon(follow, self.tool_listing, client, self._apply, self)
                            await self._dead.wait()
                            changes.cancel_scope.cancel()
                if opening.cancelled_caught:
                    silent = f"no answer within {self.connect_timeout:g} s of opening"
                    raise NoAnswer(Cause.TIMEOUT, f"MCP server {self.name!r}: {silent}")
            except Exception as exc:
                if first:  # raises NoAnswer naming the server, not the SDK's group (ADR 0117)
                    failed_opening(self.name, self.target, self.mode, exc)
                ended = describe(first_error(exc))
                logger.warning("stopline: MCP connection %s ended: %r", self.name, exc)
            self._lost(client, ended)  # and no longer the client to use
            if self._closing:
                return
            if anyio.current_time() - opened_at > self.backoff.cap:
                delays = self.backoff.delays()  # it was up a good while: start afresh
            await self._wanted.wait()
            await anyio.sleep(next(delays))

    def _lost(self, client: Client, why: str) -> None:
        """``client``'s connection ended: its calls in flight can get no answer (R3)."""
        self.last_error = why
        for call in list(self._calls.values()):
            call.connection_lost(client, why)
        if self._client is client:
            self.mark_broken()

    def mark_broken(self, client: Client | None = None) -> None:
        """The transport failed (``client``'s, when named: a newer one stays): drop this
        client; the next use opens a new one."""
        if client is not None and client is not self._client:
            return
        if self._client is not None:
            self._client, self._ready = None, anyio.Event()
        self._dead.set()

    async def open_session(self, timeout: float | None = None) -> Client:
        """The open client, (re)connecting if needed; a wait of at most ``timeout`` (and
        never more than ``connect_timeout``), else ``NoAnswer`` naming the last error."""
        limit = self.connect_timeout if timeout is None else min(timeout, self.connect_timeout)
        with anyio.move_on_after(limit):
            while self._client is None:
                if self._closing:
                    raise NoAnswer(Cause.TRANSPORT, f"MCP connection {self.name!r} is closed")
                ready = self._ready
                self._wanted.set()
                await ready.wait()
            return self._client
        raise NoAnswer(
            Cause.TRANSPORT,
            f"MCP server {self.name!r} unreachable for {limit:g}s ({self.attempts} attempts;"
            f" last: {self.last_error or 'no answer'})",
        )

    def dropped(self, client: Client) -> bool:
        """``client`` is no longer the connection's (it ended, or was dropped)."""
        return client is not self._client

    def refused(self, client: Client, request_ids: Sequence[Any]) -> int | None:
        """The HTTP status that proves one of ``request_ids`` (sent on ``client``) was
        never processed (``_http.NOT_PROCESSED``), if its server sent one."""
        refusals = self._refusals.get(id(client))
        return None if refusals is None else refusals.status_of(request_ids)

    @property
    def client(self) -> Client:
        """The SDK client of the current connection (for reads and control calls). None
        open (it was lost): it is re-opened in the background, and this raises ``NoAnswer``
        (transport); ``await open_session()`` waits for it instead."""
        if self._client is None:
            self._wanted.set()
            why = self.last_error or "not open yet"
            raise NoAnswer(Cause.TRANSPORT, f"MCP connection {self.name!r} is not open ({why})")
        return self._client

    @property
    def offers_verify(self) -> bool:
        return VERIFY_TOOL in self.listing

    # -- tools -----------------------------------------------------------------------
    @property
    def listing(self) -> dict[str, McpTool]:
        """The tools as last listed, none weaker than earlier in the session (ADR 0062)."""
        return self.tool_listing.tools

    def policy(self, name: str) -> ToolPolicy:
        """The server's declaration for ``name`` with the client's override applied."""
        listed = self.listing.get(name)
        if listed is None:
            raise UnknownTool(name, self.name)
        hint = listed.annotations.read_only_hint if listed.annotations else None
        base = policy_from_listing(listed.meta, hint, trust_read_hints=self.trust_read_hints)
        return self.policies.get(name, ToolPolicy()).merged(base)

    def tool(self, name: str) -> Tool[Any]:
        """``run.call(tool, arguments)``'s tool ``name``, re-declared in place (``_tools``)."""
        existing = self._tools.get(name)
        if existing is not None:
            if name not in self.listing:
                raise UnknownTool(name, self.name)
            return existing

        async def invoke(ctx: CallContext, arguments: dict[str, Any] | None = None) -> Any:
            with through(ctx.tool.verify_fn, ctx.key):  # read back on this connection
                return await self._invoke(name, ctx, arguments, _IDLE.get(None))

        async def read(arguments: dict[str, Any] | None = None) -> Any:
            if (why := await routed(self, name, as_read=True)) is not None:
                raise Rejected(f"not sent: {why}", ref=f"not_sent:mcp:{self.name}:{name}")
            with anyio.fail_after(idle := _IDLE.get(None)):  # a read: silence ends it
                result = await read_tool(self, name, arguments or {}, idle)
            if result.is_error:
                raise NoAnswer(Cause.SERVER_ERROR, f"tool error: {plain_result(result)}")
            return plain_result(result)

        self.policy(name)  # an unlisted name: UnknownTool
        tool: Tool[Any] = Tool(read, name=f"{self.name}/{name}", effects=False)
        tool.check_arguments = listed_check(self, name)
        self._tools[name], self._routes[name] = tool, (invoke, read)
        declare(self, name, tool, invoke, read)
        return tool

    def _apply(self, tools: Sequence[McpTool], covers: int) -> None:
        """A listing read after ``covers`` change notices: each tool re-declared."""
        self.tool_listing.apply(tools, covers)
        for name, tool in self._tools.items():
            if name in self.listing:  # a removed one stays as it was: its check refuses it
                declare(self, name, tool, *self._routes[name])

    async def call(
        self,
        run: Run,
        name: str,
        arguments: dict[str, Any] | None = None,
        *,
        key: str | None = None,
        idle_timeout: float | None = None,
        needs_approval: bool = False,
        retry: Retry | None = None,
        timeout: float | None = None,
    ) -> Any:
        """``run.call`` for the MCP tool ``name``: ``key``, ``needs_approval`` and ``retry``
        as there. ``idle_timeout`` is the silence allowed: each progress notification
        extends it, never past ``progress_cap`` from the start; it is not part of the
        call's identity. ``timeout=`` is its old name (deprecated, ADR 0030). After the
        server said its tools changed, the call is routed by the listing read again."""
        token = _IDLE.set(renamed_idle_timeout("StoplineMCP.call", idle_timeout, timeout))
        try:
            if self.tool_listing.stale:  # a failed re-list: routed by what is known
                await self.tool_listing.fresh(self.connect_timeout)
            tool, args = self.tool(name), arguments or {}
            return await run.call(tool, args, key=key, needs_approval=needs_approval, retry=retry)
        finally:
            _IDLE.reset(token)

    async def _invoke(
        self,
        name: str,
        ctx: CallContext,
        arguments: dict[str, Any] | None,
        idle_timeout: float | None,
    ) -> Any:
        if (why := await routed(self, name, as_read=False)) is not None:  # after the gate
            raise never_processed(f"mcp:{self.name}:{ctx.key}", "not_sent", f"not sent: {why}")
        policy = self.policy(name)
        args = dict(arguments or {})
        if policy.key_argument:
            args[policy.key_argument] = ctx.key
        meta: dict[str, Any] = {KEY_META: ctx.key}
        self._outcomes[ctx.op_id] = ctx.core.outcomes
        self._told.pop(ctx.op_id, None)  # a cancel an earlier attempt's end sent is not ours
        while len(self._outcomes) > 4096:
            self._outcomes.popitem(last=False)
        call = self._calls[ctx.op_id] = McpCall(self, ctx, name)
        # a cut of the awaiting scope makes the SDK send the cancel by itself
        channel = cancel_channel(self._client, self.mode, self.target)
        ctx.cancel_via(channel, lambda: self._cancel(ctx), on_cut=True)
        token = CURRENT_CALL.set(ctx)
        # The span is current while the SDK sends: its own "MCP send" span nests under it
        # and every request of this call (tools/call, tasks/*) carries its traceparent.
        with span_quietly(  # a raising span processor fails no call (ADR 0077)
            self._tracer,
            f"tools/call {name}",
            logger,
            kind=SpanKind.CLIENT,
            attributes=call.attributes,
        ) as span:
            self._spans[ctx.op_id] = span
            try:
                return await call.run(args, meta, idle_timeout, self.progress_cap)
            finally:
                CURRENT_CALL.reset(token)
                call.decided.set()  # ended: whatever the server said of a cancel is in
                del self._calls[ctx.op_id]
                del self._spans[ctx.op_id]

    # -- the provider's cancel and read-back ---------------------------------------------
    async def _cancel(self, ctx: CallContext) -> CancelState | CancelAnswer | None:
        """Ask the server to cancel the call: what it answered, as far as it can tell us.
        A server with stopline's helpers reports what it did (confirmed, refused); a task's
        ``tasks/cancel`` may get an error (ADR 0083); else there is no answer: ``None``."""
        told = self._told.pop(ctx.op_id, False) is None  # a cut already told it to stop
        call = self._calls.get(ctx.op_id)
        task = self.tasks.cancel_of(ctx) if self.tasks is not None else None
        if call is None:  # it ended: asked if a cut sent the cancel, else it finished first
            if task is not None and task.sent:  # its task's tasks/cancel: what came back
                return await task.answered()
            return None if told else CancelState.NOT_ASKED
        call.ask_cancel()
        answer = await task.answered() if task is not None else None
        if not self.offers_verify:
            return answer
        await call.decided.wait()
        if call.confirmed:
            return CancelState.CONFIRMED
        return CancelState.REFUSED if call.refused else answer

    async def status(self, key: str, *, wait_seconds: float = 0.0, tool: str | None = None) -> Any:
        """The server's ``stopline_verify`` answer (a dict) for ``key`` sent to ``tool``."""
        return await verify_status(self, key, wait_seconds, tool)

    def _spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Background work for one call (a task followed, a late answer) fails alone, logged:
        the connection's task group, which it runs in, holds every run's calls."""
        if self._tg is not None:
            self._tg.start_soon(self._alone, fn, *args)

    async def _alone(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        try:
            await fn(*args)
        except Exception:
            logger.exception("stopline: %s's background work failed (%s)", self.name, fn.__name__)

    async def _task_final(self, call: CallContext, outcome: TaskOutcome) -> None:
        """What a followed task really did, attached to its operation (R4)."""
        verdict = Verdict(outcome.proves)
        result = payload_of(outcome.result) if verdict is Verdict.COMMITTED else None
        await call.core.outcomes.late_response(
            call.op_id, verdict, result=result, ref=outcome.ref, detail=outcome.detail
        )

    def _told_stop(self, key: str, request_id: Any) -> None:
        self._told[key] = None
        if len(self._told) > 4096:  # one in, one out
            self._told.popitem(last=False)

    def _sent(self, key: str, request_id: Any) -> None:
        if (call := self._calls.get(key)) is not None:
            call.request_ids.append(request_id)
        span = self._spans.get(key)
        if span is not None:  # a re-issued request is a second id on the same operation
            span.set_attribute("jsonrpc.request.id", str(request_id))
            span.add_event("mcp.request.sent", {"jsonrpc.request.id": str(request_id)})
        if self.on_request is not None:
            self.on_request(key, request_id)

    # -- R4: late answers ------------------------------------------------------------------
    def _on_late(self, late: LateAnswer) -> None:
        self.late.append(late)
        outcomes = self._outcomes.get(late.key) if late.key else None
        if outcomes is not None:
            self._spawn(self._attach_late, outcomes, late)

    async def _attach_late(self, outcomes: Outcomes, late: LateAnswer) -> None:
        assert late.key is not None
        verdict, result, detail = classify_late(late)
        ref = f"mcp:{self.name}:request:{late.request_id}"
        await outcomes.late_response(late.key, verdict, result=result, ref=ref, detail=detail)
