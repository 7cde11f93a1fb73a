"""Verifiers of the framework adapters: the one signature, and what a server's answer proves.

Every read-back stopline runs is a ``Verifier``, ``async (ctx: CallContext) ->
ReadBack | Verdict`` (``stopline.runtime.tool``; docs/decisions/0032). The
adapters' ``verify=`` took the key alone before 0.2 (``VerifyByKey``); that form
is read for one release, with a ``DeprecationWarning``.

A framework's own MCP connection reads its tools' calls back with ``ServerReadBack``:
one declaration per server (by its name) and tool, whatever connection to it a run
uses, reading each call back through the connection it went through.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

from stopline.runtime.context import CallContext
from stopline.runtime.tool import ReadBack, Verdict, Verifier, same_function

if TYPE_CHECKING:
    from mcp_types import Tool as McpTool

__all__ = [
    "ServerReadBack",
    "VerifyByKey",
    "as_verifier",
    "read_verify",
    "server_id",
    "through",
    "wants_context",
]


# Deprecated (0.2, removed in 0.3): a verifier taking the key alone. Pass the one
# verifier signature, ``Verifier``: ``async def verify(ctx: CallContext)``, reading ``ctx.key``.
VerifyByKey = Callable[[str], Awaitable["ReadBack | Verdict"]]


def as_verifier(fn: Verifier | VerifyByKey | None) -> Verifier | None:
    """An adapter's ``verify=`` in the one verifier signature (``Verifier``).

    A function whose first parameter is named ``ctx`` or annotated ``CallContext``
    is a ``Verifier`` already. Any other is read as the earlier ``verify(key)``
    form: accepted for one release (0.2), with a ``DeprecationWarning``.
    """
    if fn is None or wants_context(fn):
        return cast("Verifier | None", fn)
    by_key = cast(VerifyByKey, fn)
    warnings.warn(
        f"a verifier taking the key ({getattr(fn, '__qualname__', fn)!r}) is deprecated "
        "and goes in 0.3: take the call's context, async def verify(ctx: CallContext), "
        "and read ctx.key",
        DeprecationWarning,
        stacklevel=3,
    )

    async def read_back(ctx: CallContext) -> ReadBack | Verdict:
        return await by_key(ctx.key)

    return read_back


async def read_verify(
    server: str,
    tools: Iterable[McpTool],
    call: Callable[[dict[str, Any]], Awaitable[Any]],
    ctx: CallContext,
    tool: str | None = None,
) -> ReadBack:
    """A framework's read-back of a call of an MCP tool: the server's ``stopline_verify``.

    ``tools`` is the server's listing; ``call`` sends the verify these arguments and
    returns its answer. ``tool`` is the name the server knows the tool by (a framework
    may list it under another, with a prefix); not given, it is the call's own tool name
    if the server lists that. The tool is named to a verify that takes it, and the
    answer is read through the one rule of ADR 0063 (``proves``): "no record of the key"
    is ``not_committed`` only for a tool whose every call the server records (the
    answer says so, or, from a server that does not say, the listing declares it);
    anything but a status record proves nothing.
    """
    from stopline.integrations.mcp import (
        VERIFY_TOOL,
        index_tools,
        policy_from_listing,
        proves,
        takes_tool,
    )

    listing = index_tools(tools)
    if VERIFY_TOOL not in listing:
        return ReadBack(Verdict.UNKNOWN, detail=f"{server} offers no {VERIFY_TOOL}")
    name = tool if tool is not None else ctx.tool.name if ctx.tool.name in listing else None
    arguments: dict[str, Any] = {"key": ctx.key}
    if name is not None and takes_tool(listing[VERIFY_TOOL]):
        arguments["tool"] = name
    try:
        status = await call(arguments)
    except Exception as exc:  # a read that failed proves nothing
        return ReadBack(Verdict.UNKNOWN, detail=f"{VERIFY_TOOL} failed: {exc}")
    if not isinstance(status, dict):
        return ReadBack(Verdict.UNKNOWN, detail=f"{VERIFY_TOOL}: {status!r}")
    listed = listing.get(name) if name is not None else None
    declared = policy_from_listing(listed.meta, None).tracked if listed is not None else None
    verdict, detail = proves(status, name or ctx.tool.name, declared)
    return ReadBack(verdict, f"{VERIFY_TOOL}:{server}:{ctx.key}", detail)


def wants_context(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes the call's context first (named ``ctx`` or annotated)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and (params[0].name == "ctx" or "CallContext" in str(params[0].annotation))


# the connection each call went through, by server and operation id (one key may be
# two ledgers'), while it may be read back (a call that answered is dropped: its outcome
# is recorded), and the connection a call of each server last went through: held while
# the connection object lives
_VIA: weakref.WeakValueDictionary[tuple[object, str], Any] = weakref.WeakValueDictionary()
_LATEST: weakref.WeakValueDictionary[object, Any] = weakref.WeakValueDictionary()


class ServerReadBack:
    """The read-back of a tool of an MCP connection (stopline's ``StoplineMCP``, a
    framework's own): ``read(connection, ctx, tool)``, the server's
    ``stopline_verify`` or a declared verifier run on that connection.

    The ledger keeps one tool per name (ADR 0078), declared by its first call, and a
    process may reach the same server through another connection (one per request, one
    opened again after the first ended): two are one declaration when they read the
    same tool of the same server (``name``: ``server_id``) the same way (ADR 0086),
    never by the connection object, which made every call through a second connection
    "another tool under a known name", refused before its gate. A call's read-back goes
    through the connection the call went through (``through``) while it lives, else the
    one a call of that server last went through, else this one. ``name=None`` (a server
    not told apart from others): only this connection."""

    def __init__(self, read: Any, connection: Any, name: object, tool: str | None) -> None:
        self.read, self.connection, self.name, self.tool = read, connection, name, tool

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ServerReadBack):
            return NotImplemented
        same = self.connection is other.connection or (
            self.name is not None and self.name == other.name
        )
        return same and self.tool == other.tool and same_function(self.read, other.read)

    def __hash__(self) -> int:
        return hash(self.tool)

    @contextlib.contextmanager
    def through(self, op_id: str) -> Iterator[None]:
        """The call ``op_id`` goes through this read-back's connection: kept for its
        read-back unless it answers (then its outcome is recorded)."""
        _VIA[self._server, op_id] = self.connection
        if self.name is not None:
            _LATEST[self.name] = self.connection
        yield
        _VIA.pop((self._server, op_id), None)

    @property
    def _server(self) -> object:
        """The server a call's connection is noted under (one key may be two ledgers')."""
        return self.name if self.name is not None else id(self.connection)

    async def __call__(self, ctx: CallContext) -> ReadBack | Verdict:
        connection = _VIA.get((self._server, ctx.key))
        if connection is None and self.name is not None:
            connection = _LATEST.get(self.name)
        if connection is None:
            connection = self.connection
        answer: ReadBack | Verdict = await self.read(connection, ctx, self.tool)
        return answer


def server_id(name: str | None, target: object) -> tuple[object, ...] | None:
    """A server's identity for ``ServerReadBack``: its name and where a connection reaches
    it (a URL, a command and its arguments, or the server object a connection in this
    process calls: per-request headers are not part of it); None if either is not
    known (then only the connection itself is the server). Two servers given one name
    are two: one's "not found" would end the other's call."""
    url = target.get("url") if isinstance(target, Mapping) else getattr(target, "url", None)
    if isinstance(target, str):
        url = target
    command, args = getattr(target, "command", None), getattr(target, "args", None)
    in_process = getattr(target, "server", None)  # FastMCP's in-memory transport
    if name is not None and url is None and command is None and in_process is not None:
        return (name, "in-process", in_process)  # equal only to the same object
    if name is None or not isinstance(url or command, str):
        return None
    return (name, str(url)) if url else (name, command, *map(str, args or ()))


def through(read_back: object, op_id: str) -> contextlib.AbstractContextManager[None]:
    """``read_back.through(op_id)`` of a ``ServerReadBack``; nothing of another (none, a
    verifier of the user's own)."""
    if isinstance(read_back, ServerReadBack):
        return read_back.through(op_id)
    return contextlib.nullcontext()
