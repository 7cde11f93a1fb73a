"""One gated MCP tool call: what is sent, how long we wait, what each answer proves.

The outcome rules (R3 throughout: no answer is never "not sent"):

============================================  =================================
what happens                                   recorded
============================================  =================================
a result, ``isError: false``                   committed (its evidence: digest)
a result, ``isError: true``                    unknown / server_error
a result the SDK refuses (its outputSchema)    unknown / server_error
error with ``data["io.stopline/outcome"]``     not_committed (refused before
``== "not_committed"``                         any effect)
HTTP 404 for the session, or 413 (the first    not_committed (never processed;
attempt's ``tools/call``)                      a 404 re-opens the connection)
error -32000 (connection closed), broken       unknown / transport
transport, malformed stream
error -32001, or our own deadline              unknown / timeout
no connection within the deadline (not sent)   not_committed
any other JSON-RPC error                       unknown / server_error
the awaiting scope is cancelled                unknown / user_cancel (the SDK
                                               sends the cancel)
============================================  =================================

A cancel of the run (any policy) stops waiting for the response, which makes
the SDK send the cancel the transport expects. A server with stopline's
helpers is then asked (``stopline_verify``, a long poll) what it did: its own
record confirms the cancel (not_committed), or shows that it refused it and
what it committed. Any other server cannot tell: the call is ``unknown``
(user_cancel) with its horizon, read back once that has passed (R13), and a
late answer still attaches (R4).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import anyio
import pydantic_core
from mcp.shared.dispatcher import ProgressFnT
from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT, CallToolResult, RequestParamsMeta
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from mcp import Client, MCPError, StdioServerParameters
from stopline.domain.vocab import Cause, NoteKind, RunState
from stopline.errors import InvalidInput, describe
from stopline.integrations.mcp._http import NOT_PROCESSED
from stopline.integrations.mcp._verdicts import UNSEEN, proves, takes_tool
from stopline.integrations.mcp._vocab import (
    ACCEPTED_MESSAGE,
    EFFECTS_META,
    MAX_VERIFY_WAIT,
    OUTCOME_DATA,
    VERIFY_TOOL,
    check_verify_wait,
)
from stopline.integrations.mcp.tasks_client import offers_legacy_tasks
from stopline.runtime.context import CallContext
from stopline.runtime.tool import NoAnswer, ReadBack, Rejected, Verdict, Verifier
from stopline.telemetry import ATTR_OP_ID, ATTR_RUN_ID

if TYPE_CHECKING:
    from stopline.integrations.mcp.client import StoplineMCP

__all__ = [
    "Deadline",
    "McpCall",
    "cancel_channel",
    "connected",
    "never_processed",
    "plain_result",
    "read_back",
    "read_tool",
    "send_call",
    "sendable",
    "verdict_of",
    "verify_status",
]


class Deadline:
    """A deadline that progress may extend, never past a hard cap.

    ``idle_timeout`` is the silence allowed between signs of life; ``cap``
    bounds the whole call, however much progress the server reports.
    """

    def __init__(self, start: float, idle_timeout: float | None, cap: float | None) -> None:
        self.start = start
        self.idle_timeout = idle_timeout
        self.cap = cap

    def initial(self) -> float:
        if self.idle_timeout is None:
            return self.start + self.cap if self.cap is not None else math.inf
        return self._bounded(self.start + self.idle_timeout)

    def extended(self, now: float) -> float:
        """The deadline after a progress notification at ``now``."""
        if self.idle_timeout is None:
            return self.initial()
        return self._bounded(now + self.idle_timeout)

    def _bounded(self, at: float) -> float:
        return at if self.cap is None else min(at, self.start + self.cap)


def sendable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """An MCP tool's ``Tool.check_arguments``: arguments the SDK cannot write as JSON (a
    lone surrogate, which UTF-8 cannot hold; a value with no JSON form) are
    ``InvalidInput`` before the gate. Written, they failed the SDK's writer and closed
    the connection, and every other call in flight on it with the one refused."""
    try:
        pydantic_core.to_json([args, kwargs])
    except pydantic_core.PydanticSerializationError as exc:
        raise InvalidInput("arguments", f"an MCP request cannot carry them: {exc}") from None


def refused_answer(exc: BaseException) -> NoAnswer | None:
    """``server_error`` when the SDK refused an answer it received (its check of a result
    against the tool's listed ``outputSchema``, ``validate_tool_result``: a misfit, no
    structured content, a schema it cannot use), else ``None``. The server answered and
    the connection is sound: dropping it ended every other call in flight on it."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "validate_tool_result":
            return NoAnswer(Cause.SERVER_ERROR, f"malformed result: {describe(exc)}")
        tb = tb.tb_next
    return None


def plain_result(result: CallToolResult) -> Any:
    """What a gated call returns: the structured content, else the text."""
    if result.structured_content is not None:
        return result.structured_content
    texts = [c.text for c in result.content if getattr(c, "type", "") == "text"]  # type: ignore[union-attr]
    return "\n".join(texts)


def payload_of(raw: Mapping[str, Any] | None) -> Any:
    """What a ``CallToolResult`` in a server's other answer (a task's) returns, as
    ``plain_result``; ``None`` when it is none: the verdict stands without it."""
    try:
        return plain_result(CallToolResult.model_validate(raw)) if raw is not None else None
    except ValidationError:
        return None


def never_processed(ref: str, proof: str, why: str) -> Rejected:
    """The one way this client records a call the evidence proves the server never
    processed: ``not_committed`` (``Rejected``, the only way there, R3), ``proof``
    naming the evidence in its ref. Either it was not sent (no connection within the
    deadline), or the server refused it unread (``_http.NOT_PROCESSED``)."""
    return Rejected(why, ref=f"{proof}:{ref}")


async def connected(verify: Verifier, conn: StoplineMCP, ctx: CallContext, _: object) -> Any:
    """A ``verifiers=`` read-back, run on ``conn`` open: a lost connection is re-opened
    first (at most ``connect_timeout``; the read-back's own time limit bounds it too),
    so ``conn.client`` in it is live. It runs even if that failed (it may read
    elsewhere; ``conn.client`` then raises ``NoAnswer``)."""
    with contextlib.suppress(NoAnswer):
        await conn.open_session()
    return await verify(ctx)


async def read_tool(
    conn: StoplineMCP, name: str, arguments: dict[str, Any], timeout: float | None
) -> CallToolResult:
    """A read (no effects: safe to repeat): on a broken connection, re-open and ask
    once more, all within the caller's deadline."""
    for attempt in (1, 2):
        client = await conn.open_session(timeout)
        try:
            return await client.call_tool(name, arguments)
        except MCPError as exc:
            # an error on a connection dropped under it (its HTTP session is gone) is
            # the connection's, not the tool's: ask again on a new one
            if exc.code != CONNECTION_CLOSED and not conn.dropped(client):
                detail = f"MCP error {exc.code}: {exc.message}"
                raise NoAnswer(Cause.SERVER_ERROR, detail) from exc
            why = f"MCP connection closed: {exc.message}"
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError) as exc:
            why = describe(exc)
        except Exception as exc:
            if (refused := refused_answer(exc)) is not None:
                raise refused from exc
            raise
        conn.mark_broken(client)
        if attempt == 2:
            raise NoAnswer(Cause.TRANSPORT, why)
    raise AssertionError("unreachable")


async def verify_status(
    conn: StoplineMCP, key: str, wait_seconds: float, tool: str | None = None
) -> dict[str, Any]:
    """The server's ``stopline_verify`` answer for ``key``, sent to ``tool`` (a read). The
    tool is named to a server whose verify takes it (ADR 0063); ``wait_seconds`` is 0 to 30,
    else ``InvalidInput``, nothing sent."""
    arguments: dict[str, Any] = {"key": key, "wait_seconds": check_verify_wait(wait_seconds)}
    if tool is not None and takes_tool(conn.listing.get(VERIFY_TOOL)):
        arguments["tool"] = tool
    try:
        result = await read_tool(conn, VERIFY_TOOL, arguments, None)
    except NoAnswer as exc:
        raise NoAnswer(exc.cause, f"verify failed: {exc.detail}") from exc
    if result.is_error or not isinstance(result.structured_content, dict):
        raise NoAnswer(Cause.SERVER_ERROR, f"verify failed: {plain_result(result)}")
    return result.structured_content


async def send_call(
    conn: StoplineMCP,
    client: Client,
    name: str,
    arguments: dict[str, Any],
    meta: dict[str, Any],
    on_progress: ProgressFnT,
) -> CallToolResult:
    """One ``tools/call``; on a 2025-11-25 connection as a task when the tool offers it."""
    listed = conn.listing.get(name)
    legacy = client.protocol_version not in MODERN_PROTOCOL_VERSIONS
    if conn.tasks is not None and legacy and listed is not None:
        offered = offers_legacy_tasks(client.server_capabilities, listed)
        required = listed.execution is not None and listed.execution.task_support == "required"
        if offered and (conn.policy(name).task or required):
            return await conn.tasks.call_legacy(client.session, name, arguments, meta, on_progress)
    return await client.call_tool(
        name, arguments, progress_callback=on_progress, meta=cast(RequestParamsMeta, meta)
    )


def may_reissue(conn: StoplineMCP, name: str, client: Client, attempt: int) -> bool:
    """Re-send a ``tools/call`` whose stream broke? Once, on 2026-07-28, and only when the
    idempotency key provably survives the re-issue: in the arguments (the client's own
    ``key_argument``), or in ``_meta`` for a server that reads it (it declares
    ``io.stopline/effects``). A tool's ``idempotentHint`` is a hint from the server, which
    the client cannot check: reported, not relied on (ADR 0055), so it re-issues nothing."""
    if attempt >= 2 or client.protocol_version not in MODERN_PROTOCOL_VERSIONS:
        return False
    listed = conn.listing.get(name)
    if listed is None:
        return False
    reads_key = EFFECTS_META in (listed.meta or {})
    return bool(conn.policy(name).key_argument) or reads_key


def cancel_channel(client: Client | None, mode: str, target: object) -> str:
    """How the SDK delivers a cancel on a connection (``client``, else as ``mode`` asks)."""
    modern = client.protocol_version in MODERN_PROTOCOL_VERSIONS if client else mode != "legacy"
    if modern and not isinstance(target, StdioServerParameters):
        return "stream_close"  # 2026-07-28 Streamable HTTP: closing the stream is the cancel
    return "notifications/cancelled"


def verdict_of(conn: StoplineMCP, name: str, status: dict[str, Any]) -> tuple[Verdict, str]:
    """What the server's answer for a key sent to tool ``name`` proves (``_verdicts``):
    "no record" proves "not committed" only for a tool the server tracks."""
    declared = conn.policy(name).tracked if name in conn.listing else None
    return proves(status, name, declared)


async def read_back(conn: StoplineMCP, ctx: CallContext, name: str) -> ReadBack:
    """The server's ``stopline_verify`` as the read-back of a call of tool ``name``."""
    try:
        # an attempt still running at the server is waited for (a long poll): its
        # "in progress" proves nothing, and the budget may end before it does (R13)
        status = await verify_status(conn, ctx.key, min(conn.poll_wait, MAX_VERIFY_WAIT), name)
    except NoAnswer as exc:
        if exc.cause is Cause.TRANSPORT:
            conn.mark_broken()
        return ReadBack(Verdict.UNKNOWN, detail=exc.detail)
    verdict, detail = verdict_of(conn, name, status)
    ref = f"{VERIFY_TOOL}:{conn.name}:{ctx.key}"
    # the server's own record of the request: its "not committed" means it ended
    return ReadBack(verdict, ref, detail, status.get("result"), ended=True)


class McpCall:
    """The state of one call in flight, shared with its ``cancel_fn``."""

    def __init__(self, conn: StoplineMCP, ctx: CallContext, mcp_name: str) -> None:
        self.conn = conn
        self.ctx = ctx
        self.mcp_name = mcp_name
        self.scope = anyio.CancelScope()
        self.cancel_asked = False
        self.decided = anyio.Event()  # the server's answer to our cancel is known
        self.confirmed = False
        self.refused = False
        self.client: Client | None = None  # the connection the current attempt was sent on
        self.lost = ""  # why that connection ended under the attempt, when it did
        self._attempt_scope: anyio.CancelScope | None = None
        self.request_ids: list[Any] = []  # each attempt's JSON-RPC id, as the tap saw it

    @property
    def attributes(self) -> dict[str, Any]:
        """The MCP SDK's own span attributes, plus stopline's operation and run."""
        return {
            "mcp.method.name": "tools/call",
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": self.mcp_name,
            "mcp.server.name": self.conn.name,
            ATTR_OP_ID: self.ctx.op_id,
            ATTR_RUN_ID: self.ctx.run_id,
        }

    @property
    def ref(self) -> str:
        return f"mcp:{self.conn.name}:{self.ctx.key}"

    async def run(
        self,
        arguments: dict[str, Any],
        meta: dict[str, Any],
        idle_timeout: float | None,
        cap: float | None,
    ) -> Any:
        deadline = Deadline(anyio.current_time(), idle_timeout, cap)

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            if message == ACCEPTED_MESSAGE:
                await self.ctx.accepted(ref=self.ref, detail="the server accepted the request")
            else:
                await self.ctx.progress(progress, total, message or "")
            if not self.cancel_asked:  # advisory: may extend the wait, up to the cap
                self.scope.deadline = deadline.extended(anyio.current_time())

        left = deadline.initial() - anyio.current_time()
        try:  # reconnecting counts against the call's deadline
            client = await self.conn.open_session(None if math.isinf(left) else max(left, 0.0))
        except NoAnswer as exc:  # no connection, so nothing was sent: provably not committed
            raise never_processed(self.ref, "not_sent", f"not sent: {exc.detail}") from exc
        self.scope.deadline = deadline.initial()
        if cap is not None:  # R13: no answer is awaited past this; the stated horizon,
            # never before the tool's declared one (the server's work may outlive our wait)
            declared = self.ctx.tool.settles_within
            self.ctx.settles_by(self.ctx.started_at + max(cap, declared or 0.0))
        with self.scope:
            attempt = 1
            while True:
                try:
                    result = await self._attempt(client, arguments, meta, on_progress)
                except NoAnswer as exc:
                    if exc.cause is not Cause.TRANSPORT or not may_reissue(
                        self.conn, self.mcp_name, client, attempt
                    ):
                        raise
                    run = await self.ctx.core.backend.get_run(self.ctx.run_id)
                    if run.state is not RunState.RUNNING:
                        raise  # fenced (or pausing) meanwhile: a re-issue is new work (R1)
                    attempt += 1  # 2026-07-28: a broken stream lost the request; re-issue it
                    await self.ctx.core.backend.note(
                        self.ctx.op_id,
                        NoteKind.MCP_REISSUED,
                        {"attempt": attempt, "after": exc.detail, "key": self.ctx.key},
                    )
                    try:
                        client = await self.conn.open_session()
                    except NoAnswer:
                        raise exc from None  # the first attempt was sent: its outcome is unknown
                    continue
                if result.is_error:
                    raise NoAnswer(Cause.SERVER_ERROR, f"tool error: {plain_result(result)}")
                if attempt > 1:  # R8/R14: the receipt's evidence says it was sent twice
                    self.ctx.provider_ref = f"{self.ref}:sent_twice:{self._ids()}"
                return plain_result(result)
        if not self.cancel_asked:
            why = f"no answer within the deadline (idle_timeout {idle_timeout}s, cap {cap}s)"
            raise NoAnswer(Cause.TIMEOUT, why)
        return await self._after_cancel()

    async def _attempt(
        self,
        client: Client,
        arguments: dict[str, Any],
        meta: dict[str, Any],
        on_progress: ProgressFnT,
    ) -> CallToolResult:
        """One ``tools/call`` (a new JSON-RPC id each time), its failure said as NoAnswer.
        A connection that ends under it ends it at once (``connection_lost``)."""
        self.client, self.lost = client, ""
        earlier = len(self.request_ids)  # this call's requests sent before this attempt
        failure: Exception
        cause: Exception | None = None
        try:
            with anyio.CancelScope() as self._attempt_scope:
                return await send_call(
                    self.conn, client, self.mcp_name, arguments, meta, on_progress
                )
        except MCPError as exc:
            failure, cause = self._no_answer(exc), exc
        except NoAnswer as exc:
            failure = exc  # already says why (e.g. a task that vanished)
        except ValidationError as exc:
            failure, cause = NoAnswer(Cause.SERVER_ERROR, f"malformed result: {exc}"), exc
        except Exception as exc:
            refused = refused_answer(exc)
            if refused is None:  # the SDK's own failure: the connection cannot be trusted
                self.conn.mark_broken(client)
            failure, cause = refused or NoAnswer(Cause.TRANSPORT, describe(exc)), exc
        else:  # only ``connection_lost`` cancels this scope: the request may have been read
            failure = NoAnswer(Cause.TRANSPORT, f"MCP connection ended: {self.lost}")
        finally:
            self._attempt_scope = None
        # whatever surfaced first (a 404 also drops the connection under the call), the
        # server's HTTP refusal of the only request this call sent proves it unprocessed
        status = self.conn.refused(client, self.request_ids[earlier:])
        if status is not None and not isinstance(failure, Rejected) and earlier == 0:
            why = f"not processed: {NOT_PROCESSED[status]}"
            raise never_processed(self.ref, f"http_{status}", why) from cause or failure
        if cause is None:
            raise failure
        raise failure from cause

    def connection_lost(self, client: Client, why: str) -> None:
        """``client``'s connection ended (the transport failed: bytes it could not read, a
        closed pipe): an attempt sent on it can get no answer, so it ends now, ``unknown``
        with cause transport (R3), instead of waiting out its deadline."""
        if self.client is client and self._attempt_scope is not None:
            self.lost = why or "the transport failed"
            self._attempt_scope.cancel()

    def _ids(self) -> str:
        return "+".join(str(i) for i in self.request_ids) or "?"

    def _no_answer(self, exc: MCPError) -> Exception:
        data = exc.data if isinstance(exc.data, dict) else {}
        if data.get(OUTCOME_DATA) == "not_committed":
            return Rejected(exc.message, ref=self.ref)
        if exc.code == CONNECTION_CLOSED:
            self.conn.mark_broken(self.client)
            return NoAnswer(Cause.TRANSPORT, f"MCP connection closed: {exc.message}")
        if exc.code == REQUEST_TIMEOUT:
            return NoAnswer(Cause.TIMEOUT, exc.message)
        return NoAnswer(Cause.SERVER_ERROR, f"MCP error {exc.code}: {exc.message}")

    # -- a cancel under a verify / at_boundary policy ----------------------------
    def ask_cancel(self) -> None:
        """Stop waiting: the SDK sends the cancel the transport expects."""
        self.cancel_asked = True
        self.scope.cancel()

    async def _after_cancel(self) -> Any:
        """Learn from the server's own record what it did with the cancelled request."""
        conn = self.conn
        if not conn.offers_verify:  # a server without stopline's helpers cannot tell us
            self.decided.set()
            raise NoAnswer(Cause.USER_CANCEL, "cancel sent; the server reports no outcome")
        # a plain read first: what the server noted of the cancel (its refusal) is known at
        # once, not when a long poll for the attempt's outcome ends; then long polls
        wait = 0.0
        with anyio.move_on_after(conn.settle_timeout):
            while True:
                try:
                    status = await verify_status(conn, self.ctx.key, wait, self.mcp_name)
                except NoAnswer:
                    break  # the connection is gone: unknown, reconciled later
                wait = min(conn.poll_wait, MAX_VERIFY_WAIT)
                verdict = verdict_of(conn, self.mcp_name, status)[0].value
                if status.get("cancel") == "refused" and not self.decided.is_set():
                    self.refused = True
                    self.decided.set()  # the server goes on: its answer to the cancel is no
                if verdict == "committed":
                    self.decided.set()
                    return status.get("result")
                if verdict == "not_committed":
                    self.confirmed = True
                    self.decided.set()
                    detail = status.get("detail") or "stopped before any effect"
                    raise Rejected(f"cancelled at the server: {detail}", ref=self.ref)
                if status.get("state") in ("unknown", UNSEEN):
                    break  # the server itself cannot tell (or has no record it can trust)
        self.decided.set()
        raise NoAnswer(Cause.USER_CANCEL, "cancel sent; the server has not reported an outcome")
