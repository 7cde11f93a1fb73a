"""Whose calls a server's ``Effects`` record holds, and what it saw of each keyed call.

The rule ``stopline_verify`` answers by is ``_verdicts``' (ADR 0063): "no record of
the key" proves "not committed" only for a tool declared ``io.stopline/tracked``,
which records every call its body runs. This module keeps the evidence that rule
needs, for every server process on the file (ADR 0067):

- **Arrival.** ``hook`` wraps the server's ``MCPServer.call_tool``, where the SDK checks
  a call's arguments and runs the tool. A keyed call of a tracked tool is written down
  there (``stopline_arrivals``) before either, and stays so until the call records
  (``begin`` ends it) or ends. Another server on the file reads the key in flight, not
  "never seen"; after this process dies, the call reads as one that left no record.
- **How a call that recorded nothing ended.** The SDK refuses arguments that fail the
  tool's input model before its body runs, raising a ``ToolError`` caused by the
  pydantic ``ValidationError``; its request handler then turns it into an ``isError``
  result no client can tell from the body's own failure. Read where it is raised, such
  a refusal ran nothing and marks nothing; a call whose body may have run (it failed,
  was cancelled, answered) and recorded nothing marks its key, durably: ``unknown``. A
  tool that answered unrecorded is also tracked no more in this process (its
  declaration is false).
- **The listing**, read once and again only after the server's tools changed (its
  ``add_tool``/``remove_tool``, before any change notice can leave), each name keeping
  the most conservative declaration it had in this process (``Listing``, ADR 0062): a
  tool declared tracked after it served calls untracked is not believed.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import anyio
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp_types import CallToolResult
from mcp_types import Tool as McpTool
from pydantic import ValidationError

from mcp import MCPError
from stopline.domain.limits import check_id
from stopline.errors import InvalidInput, describe
from stopline.integrations.mcp._listing import Listing
from stopline.integrations.mcp._store import EffectStore, Ending
from stopline.integrations.mcp._verdicts import declares_tracked, untracked
from stopline.integrations.mcp._vocab import KEY_META, OUTCOME_DATA, REJECTED_CODE, TRACKED_META

__all__ = ["Call", "Tracking", "peer_of", "rejected", "this_call", "usable_key"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Call:
    """A keyed call of a tool declared tracked, from the moment the SDK is about to check
    its arguments and run it, as this process sees it."""

    key: str
    tool: str
    arrival: int | None = None  # its row in ``stopline_arrivals`` until it records or ends
    recorded: bool = False  # an operation of it claimed the key (``begin``)

    def began(self) -> None:
        """An operation of this call claimed its key: the record holds it now (the
        claim's transaction ended the arrival)."""
        self.recorded, self.arrival = True, None


_CURRENT: contextvars.ContextVar[Call | None] = contextvars.ContextVar(
    "stopline_mcp_call", default=None
)


def this_call(key: str) -> Call | None:
    """The call being run, when it is a keyed call of a tracked tool with ``key`` (a
    worker thread of a ``def`` tool sees it too: anyio copies the context)."""
    call = _CURRENT.get()
    return call if call is not None and call.key == key else None


def usable_key(value: object) -> str | None:
    """``value`` if it can be an idempotency key (``check_id``: what the ledger takes for
    an id), else ``None``: a request with no usable key is no keyed call."""
    try:
        return check_id("key", value)
    except InvalidInput:
        return None


def peer_of(ctx: ServerRequestContext[Any, Any]) -> str:
    """Which client sent this message, so that a cancel names only that client's request.

    JSON-RPC request ids are chosen by each client, so two clients of one HTTP
    server use the same ids. Stdio has one client per process (``""``);
    Streamable HTTP names its session in a header, SSE in the query; an HTTP
    message of no session (stateless) is its own peer: a cancel sent in another
    exchange names none of its requests (the SDK could not cancel it either).
    """
    request = ctx.request
    if request is None:
        return ""
    headers, query = getattr(request, "headers", {}), getattr(request, "query_params", {})
    session = headers.get("mcp-session-id") or query.get("session_id")
    return f"session:{session}" if session else f"exchange:{id(request)}"


def rejected(reason: str) -> MCPError:
    """The error that tells a client its request was refused before any effect."""
    return MCPError(code=REJECTED_CODE, message=reason, data={OUTCOME_DATA: "not_committed"})


def _refused_arguments(exc: ToolError) -> bool:
    """The SDK refused the arguments before the tool's body (or any resolver) ran: the
    one ``ToolError`` its ``Tool.run`` raises from the input model's ``ValidationError``
    (a body's own error is wrapped in an ``UnexpectedToolError``, or chained to the
    body's ``ToolError``)."""
    return not isinstance(exc, UnexpectedToolError) and isinstance(exc.__cause__, ValidationError)


class Tracking:
    """Which tools' calls a server's record holds, and the calls of them in this process."""

    def __init__(self, store: EffectStore) -> None:
        self.store = store
        self.server: MCPServer[Any] | None = None  # set by ``hook``
        self.demoted: set[str] = set()  # tools seen answering a call unrecorded
        self.listing = Listing()  # the server's own tools, most conservative per name

    # -- the listing --------------------------------------------------------------------
    async def tools(self) -> dict[str, McpTool]:
        """The server's tools by name, read again only after they changed."""
        if self.server is None:
            return {}
        while self.listing.stale:
            covers = self.listing.notices
            self.listing.apply(await self.server.list_tools(), covers)
        return self.listing.tools

    async def why_untracked(self, tool: str | None) -> str | None:
        """Why "no record" proves nothing for ``tool`` (``untracked``); ``None``: it proves
        "not committed"."""
        if self.server is None:
            return "this record serves no MCP server (Effects.install was not called)"
        return untracked((await self.tools()).values(), tool, self.demoted)

    # -- the server's calls ---------------------------------------------------------------
    def hook(self, server: MCPServer[Any]) -> None:
        """Follow ``server``'s tool changes and read how each of its tool calls ends."""
        if self.server is not None:  # one record follows the tools of one server
            raise InvalidInput("server", "this Effects record is installed on another server")
        self.server = server
        self.listing.notice()  # never read yet
        for name in ("add_tool", "remove_tool"):
            setattr(server, name, self._changing(getattr(server, name)))
        server.call_tool = self._calling(server.call_tool)  # type: ignore[method-assign]

    def _changing(self, change: Callable[..., None]) -> Callable[..., None]:
        def changed(*args: Any, **kwargs: Any) -> None:
            try:
                change(*args, **kwargs)
            finally:
                self.listing.notice()  # read again before the next answer relies on it

        return changed

    def _calling(self, call_tool: Callable[..., Any]) -> Callable[..., Any]:
        async def calling(name: str, arguments: dict[str, Any], context: Any = None) -> Any:
            call = await self._arrive(name, context)
            if call is None:
                return await call_tool(name, arguments, context)
            token = _CURRENT.set(call)
            ending: Ending | None = Ending.FAILED
            try:
                out = await call_tool(name, arguments, context)
                if isinstance(out, CallToolResult) and not out.is_error:
                    ending = Ending.ANSWERED
                return out
            except ToolError as exc:
                if _refused_arguments(exc):
                    ending = None  # nothing of the tool ran
                raise
            except anyio.get_cancelled_exc_class():
                ending = Ending.CANCELLED
                raise
            finally:
                _CURRENT.reset(token)
                with anyio.CancelScope(shield=True):
                    await self._settle(call, ending)

        return calling

    async def _arrive(self, tool: str, context: Any) -> Call | None:
        """A keyed call of a tool declared tracked, about to be checked and run, written
        down first; ``None`` for any other call (a tool whose "no record" proves nothing
        anyway, a call with no usable key, one a tool of this request makes in-process)."""
        request = getattr(context, "request_context", None) if context is not None else None
        meta = getattr(request, "meta", None)
        key = usable_key(meta.get(KEY_META)) if isinstance(meta, dict) else None
        if key is None or _CURRENT.get() is not None:
            return None
        listed = (await self.tools()).get(tool)
        if listed is None or not declares_tracked(listed):
            return None
        call = Call(key, tool)
        try:
            with anyio.CancelScope(shield=True):  # a cancel now must not leave the row unowned
                call.arrival = await anyio.to_thread.run_sync(self.store.arrive, key, tool)
        except Exception as exc:  # the record cannot follow the call: it is not run
            why = f"the server could not record this call ({describe(exc)}); it was not run"
            raise rejected(why) from exc
        return call

    async def _settle(self, call: Call, ending: Ending | None) -> None:
        """``call`` ended: nothing to do when it recorded; else its arrival ends, and its
        key is marked with ``ending`` (``None``: nothing of the tool ran). A tool that
        answered with no record of the key at all is tracked no more in this process."""
        if call.recorded:
            return
        store = self.store
        try:
            held = await anyio.to_thread.run_sync(
                lambda: store.settle(call.arrival, call.key, call.tool, ending)
            )
        except Exception as exc:  # the call's own outcome stands; its arrival stays behind
            logger.warning(
                "stopline: the end of a call of %r could not be recorded (%s); its key reads"
                " in progress while this process runs, then unknown",
                call.tool,
                describe(exc),
            )
            return
        if ending is Ending.ANSWERED and not held:
            if call.tool not in self.demoted:
                logger.warning(
                    "stopline: tool %r declares %s but answered a call without recording it"
                    " through Effects; stopline_verify answers unknown for it from now on",
                    call.tool,
                    TRACKED_META,
                )
            self.demoted.add(call.tool)
