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

A call's arguments are checked against the tool's listed ``inputSchema`` before the
gate (``fits_schema``; ``StoplineMCP(..., check_input_schemas=False)``: not): a server
validates them before its tool runs and, since 2025-11-25, answers a misfit as a tool
error (``isError: true``, which proves nothing), so sent they left an ``unknown``
operation to read back for a call that never ran. A listed schema the validator cannot
use (invalid, or one whose use fails: a ``$ref`` that resolves nowhere, a schema that
refers to itself whole) checks nothing, said once per listing in the log: the call is
gated and sent, and the server judges its arguments (ADR 0122).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jsonschema

from stopline.domain.vocab import Cancellable
from stopline.errors import InvalidInput, UnknownTool
from stopline.integrations._verify import ServerReadBack, server_id
from stopline.integrations.mcp._call import connected, read_back, sendable
from stopline.runtime.tool import Tool

if TYPE_CHECKING:
    from stopline.integrations.mcp.client import StoplineMCP

__all__ = ["declare", "fits_schema", "listed_check", "routed"]

logger = logging.getLogger(__name__)


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
    before the gate (``UnknownTool``); arguments no request can carry, or (when the
    connection checks them) that its listed ``inputSchema`` refuses, ``InvalidInput``."""

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name not in conn.listing:
            raise UnknownTool(name, conn.name)
        sendable(args, kwargs)
        arguments = args[0] if args else kwargs.get("arguments")
        if conn.check_input_schemas and (arguments is None or isinstance(arguments, dict)):
            fits_schema(conn, name, arguments or {})

    return check


def fits_schema(conn: StoplineMCP, name: str, arguments: dict[str, Any]) -> None:
    """``InvalidInput`` unless ``arguments`` (with the key the client adds, when the
    tool's policy names a ``key_argument``) fit ``name``'s listed ``inputSchema``. A
    schema the validator cannot use checks nothing (logged once): the server judges."""
    schema = conn.listing[name].input_schema
    key_argument = conn.policy(name).key_argument
    if key_argument:  # the client sets it after this check: as the server will get it
        arguments = {**arguments, key_argument: "io.stopline/key"}
    validator = _validator(conn, name, schema)
    if validator is None:
        return
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    except Exception as exc:  # the schema's use failed, not the arguments: unusable
        _unusable(conn, name, exc)
        _VALIDATORS[conn][name] = (schema, None)
        return
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "arguments"
        why = f"tool {name!r} of {conn.name!r} takes no such arguments: {where}: {error.message}"
        raise InvalidInput("arguments", why)


# each connection's validators by tool name, with the listed schema each was made of: a
# call is checked against its tool's schema as listed now, made again only once a new
# listing replaced it (not the schema serialized at every call to find it in a cache)
_VALIDATORS: weakref.WeakKeyDictionary[StoplineMCP, dict[str, tuple[object, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _validator(conn: StoplineMCP, name: str, schema: dict[str, Any]) -> Any:
    """The validator of ``name``'s listed ``schema``, or ``None`` for one that is no
    valid schema (or whose use failed before)."""
    made = _VALIDATORS.setdefault(conn, {})
    held = made.get(name)
    if held is not None and held[0] is schema:
        return held[1]
    try:
        default = jsonschema.Draft202012Validator
        cls = jsonschema.validators.validator_for(schema, default=default)
        cls.check_schema(schema)
        validator: Any = cls(schema)
    except Exception as exc:  # SchemaError, or a dialect no validator knows
        _unusable(conn, name, exc)
        validator = None
    made[name] = (schema, validator)
    return validator


def _unusable(conn: StoplineMCP, name: str, exc: Exception) -> None:
    """Said once per listed schema: ``name``'s calls are not checked (ADR 0122)."""
    why = str(exc).split("\n", 1)[0][:200]
    logger.warning(
        "stopline: MCP server %r lists tool %r with an inputSchema no validator can use"
        " (%s: %s): its calls are gated and sent unchecked; the server judges their"
        " arguments",
        conn.name,
        name,
        type(exc).__name__,
        why,
    )


async def routed(conn: StoplineMCP, name: str, *, as_read: bool) -> str | None:
    """Why a call routed by ``name``'s declaration must not be sent, once the listing is
    current: removed; for a read, no longer a read, or the listing not read again."""
    why = await conn.tool_listing.fresh(conn.connect_timeout)
    if name not in conn.listing:
        return f"the server no longer lists tool {name!r}"
    if as_read and conn.tool(name).effects:
        return f"the server now declares {name!r} effectful; called again, it is gated"
    return why if as_read else None
