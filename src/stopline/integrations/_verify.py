"""Verifiers of the framework adapters: the one signature, and what a server's answer proves.

Every read-back stopline runs is a ``Verifier``, ``async (ctx: CallContext) ->
ReadBack | Verdict`` (``stopline.runtime.tool``; docs/decisions/0032). The
adapters' ``verify=`` took the key alone before 0.2 (``VerifyByKey``); that form
is read for one release, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from stopline.runtime.context import CallContext
from stopline.runtime.tool import ReadBack, Verdict, Verifier

if TYPE_CHECKING:
    from mcp_types import Tool as McpTool

__all__ = ["VerifyByKey", "as_verifier", "read_verify", "wants_context"]


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
