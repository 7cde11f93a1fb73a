"""One ``stopline.Tool`` per MCP tool, declared as the server's listing says, kept so.

A server's listing may change under the session (``notifications/tools/list_changed``,
a new connection). The client keeps one ``Tool`` per name and re-declares it in place
when a listing is read, so a ``Tool`` a caller holds follows too (ADR 0062):

- a read becomes effectful when the server says so; an effectful tool never becomes a
  read (a call of it may be between its gate and its send, and the listing a tool's
  declaration comes from is already never weaker than an earlier one, ``_listing``);
- a call is routed by a current listing: after a change notice it waits (at most
  ``connect_timeout``) for the listing read again; one whose tool was removed is not
  sent (before the gate ``UnknownTool``; after it ``not_committed``, nothing sent), and
  a read whose tool became effectful is not sent (``Rejected``; called again, it is
  gated).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stopline.domain.vocab import Cancellable
from stopline.errors import UnknownTool
from stopline.integrations._verify import ServerReadBack, server_id
from stopline.integrations.mcp._call import connected, read_back, sendable
from stopline.runtime.tool import Tool

if TYPE_CHECKING:
    from stopline.integrations.mcp.client import StoplineMCP

__all__ = ["declare", "listed_check", "routed"]


def declare(conn: StoplineMCP, name: str, tool: Tool[Any], invoke: Any, read: Any) -> None:
    """``tool`` as ``conn``'s current listing declares ``name`` (``invoke`` gated,
    ``read`` not)."""
    policy, listed = conn.policy(name), conn.listing[name]
    was_gated = tool.effects and tool.fn is invoke
    effects = policy.effects is not False or was_gated
    tool.fn, tool.effects, tool.wants_context = (invoke if effects else read), effects, effects
    tool.description = listed.title or (listed.description or "").strip().split("\n")[0] or name
    tool.cancellable = policy.cancellable or Cancellable.UNTIL_ACCEPTED
    tool.settles_within = policy.settles_within
    user_verify = conn.verifiers.get(name)
    use_server = policy.verify if policy.verify is not None else conn.offers_verify
    tool.verify_fn = None
    # read back on the connection a call went through: one declaration for every
    # connection of this name (one per request, one opened again), ADR 0086
    if effects and user_verify is not None:  # a read: nothing to verify or cancel
        read = functools.partial(connected, user_verify)
        tool.verify_fn = ServerReadBack(read, conn, server_id(conn.name, conn.target), name)
    elif effects and use_server and conn.offers_verify:
        tool.verify_fn = ServerReadBack(read_back, conn, server_id(conn.name, conn.target), name)


def listed_check(conn: StoplineMCP, name: str) -> Callable[[tuple[Any, ...], dict[str, Any]], None]:
    """The tool's ``check_arguments``: a tool the listing no longer names is refused
    before the gate (``UnknownTool``); arguments no request can carry, ``InvalidInput``."""

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name not in conn.listing:
            raise UnknownTool(name, conn.name)
        sendable(args, kwargs)

    return check


async def routed(conn: StoplineMCP, name: str, *, as_read: bool) -> str | None:
    """Why a call routed by ``name``'s declaration must not be sent, once the listing is
    current: removed; for a read, no longer a read, or the listing not read again."""
    why = await conn.tool_listing.fresh(conn.connect_timeout)
    if name not in conn.listing:
        return f"the server no longer lists tool {name!r}"
    if as_read and conn.tool(name).effects:
        return f"the server now declares {name!r} effectful; called again, it is gated"
    return why if as_read else None
