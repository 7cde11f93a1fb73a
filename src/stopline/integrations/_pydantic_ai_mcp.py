"""Pydantic AI and MCP: the tools of a ``StoplineMCP`` connection as a toolset
(``mcp_toolset``), and what the gate adds to Pydantic AI's own MCP toolsets.

Split from ``pydantic_ai`` (which re-exports the public names here): each call of
``mcp_toolset`` is ``conn.call`` in the bound run, keyed by the model's
``tool_call_id``. A native ``MCPToolset``'s call carries its operation id in
``_meta`` (``with_key``, its ``process_tool_call``) and is read back through
the server's ``stopline_verify`` (``mcp_verify``, naming the tool as the server knows
it: ``mcp_name``), the server named by a name that is the same in every process
(``server_name``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from pydantic_ai.mcp import CallToolFunc
from pydantic_ai.mcp import MCPToolset as NativeMCPToolset
from pydantic_ai.tools import RunContext, ToolDefinition
from pydantic_ai.toolsets import (
    AbstractToolset,
    PrefixedToolset,
    RenamedToolset,
    ToolsetTool,
    WrapperToolset,
)
from pydantic_ai.toolsets.external import TOOL_SCHEMA_VALIDATOR

from stopline.integrations._frameworks import mcp_call, read_verify
from stopline.integrations._renamed import renamed_idle_timeout
from stopline.integrations.mcp import KEY_META, VERIFY_TOOL
from stopline.runtime.context import CallContext
from stopline.runtime.tool import ReadBack, Verdict

if TYPE_CHECKING:
    from stopline.integrations.mcp import StoplineMCP

__all__ = [
    "MCPToolset",
    "history_key",
    "known_name",
    "mcp_name",
    "mcp_toolset",
    "mcp_verify",
]

# the operation id of the MCP call in progress, for its ``_meta`` (``with_key``)
OP_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "stopline_pydantic_ai_op_id", default=None
)


def history_key(tool_call_id: str) -> str:
    """The operation key of a tool call (``<run id>/<key>`` is its id)."""
    return f"tool:{tool_call_id}"


class MCPToolset(AbstractToolset[Any]):
    """The tools of an MCP server, called through ``StoplineMCP`` in the current run."""

    def __init__(
        self,
        conn: StoplineMCP,
        *,
        include: Collection[str] | None = None,
        exclude: Collection[str] = (),
        idle_timeout: float | None = None,
        id: str | None = None,
        timeout: float | None = None,
    ) -> None:
        from stopline.integrations.mcp import VERIFY_TOOL  # the extra is needed only here

        self.conn = conn
        self.include = None if include is None else frozenset(include)
        self.exclude = frozenset({VERIFY_TOOL, *exclude})  # stopline's read-back, not the model's
        self.idle_timeout = renamed_idle_timeout("MCPToolset", idle_timeout, timeout)
        self._id = id

    @property
    def id(self) -> str | None:
        return self._id

    @property
    def label(self) -> str:
        return f"MCP server {self.conn.name!r} (stopline)"

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        """The server's ``tools/list`` (as of the current connection)."""
        tools: dict[str, ToolsetTool[Any]] = {}
        for name, listed in self.conn.listing.items():
            if name in self.exclude or (self.include is not None and name not in self.include):
                continue
            tool_def = ToolDefinition(
                name=name,
                description=listed.description or listed.title,
                parameters_json_schema=dict(listed.input_schema),
                metadata={"meta": listed.meta, "mcp_server": self.conn.name},
            )
            tools[name] = ToolsetTool(
                toolset=self, tool_def=tool_def, max_retries=0, args_validator=TOOL_SCHEMA_VALIDATOR
            )
        return tools

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        """``conn.call`` in the bound run, keyed by the model's ``tool_call_id``."""
        key = history_key(ctx.tool_call_id) if ctx.tool_call_id else None
        return await mcp_call(self.conn, name, tool_args, key=key, idle_timeout=self.idle_timeout)


def mcp_toolset(
    conn: StoplineMCP,
    *,
    include: Collection[str] | None = None,
    exclude: Collection[str] = (),
    idle_timeout: float | None = None,
    timeout: float | None = None,
) -> MCPToolset:
    """A toolset of ``conn``'s tools (``include``/``exclude`` by name); calls pass the gate.
    ``idle_timeout``: the silence allowed in each call (``timeout=``: its old name)."""
    idle = renamed_idle_timeout("mcp_toolset", idle_timeout, timeout)
    return MCPToolset(conn, include=include, exclude=exclude, idle_timeout=idle)


async def with_key(
    user_hook: Any, ctx: RunContext[Any], call_tool: CallToolFunc, name: str, args: dict[str, Any]
) -> Any:
    """``process_tool_call``: the operation id in the request's ``_meta`` (the server's key)."""
    op_id = OP_ID.get()

    async def keyed(
        name: str, args: dict[str, Any], *, metadata: dict[str, Any] | None = None
    ) -> Any:
        meta = {**(metadata or {}), **({KEY_META: op_id} if op_id else {})}
        return await call_tool(name, args, metadata=meta or None)

    if user_hook is not None:
        return await user_hook(ctx, keyed, name, args)
    return await keyed(name, args)


def key_in_meta(toolset: AbstractToolset[Any]) -> None:
    """Install ``with_key`` on an MCP toolset, around the hook it has (once)."""
    if isinstance(toolset, NativeMCPToolset):
        hook = toolset.process_tool_call
        if not isinstance(hook, functools.partial) or hook.func is not with_key:
            toolset.process_tool_call = functools.partial(with_key, hook)


async def mcp_verify(
    server: NativeMCPToolset[Any], ctx: CallContext, tool: str | None = None
) -> ReadBack:
    """The server's own record of the key (``stopline_verify``, ``read_verify``), when it
    offers one; ``tool``: the name the server knows the tool by (``mcp_name``)."""

    async def verify(arguments: dict[str, Any]) -> Any:
        return await server.direct_call_tool(VERIFY_TOOL, arguments)

    try:
        tools = await server.list_tools()
    except Exception as exc:  # a read that failed proves nothing
        return ReadBack(Verdict.UNKNOWN, detail=f"{VERIFY_TOOL} failed: {exc}")
    return await read_verify(server_name(server), tools, verify, ctx, tool)


def mcp_name(tool: ToolsetTool[Any]) -> str | None:
    """The name the MCP server knows ``tool`` by, as a toolset over the server lists it:
    each ``PrefixedToolset`` and ``RenamedToolset`` on the way down undone; ``None`` when
    no MCP server is under it."""
    leaf = tool
    while (inner := getattr(leaf, "source_tool", None)) is not None:
        leaf = inner
    name, owner = leaf.tool_def.name, leaf.toolset
    while isinstance(owner, WrapperToolset):
        if isinstance(owner, PrefixedToolset):
            name = name.removeprefix(f"{owner.prefix}_")
        elif isinstance(owner, RenamedToolset):
            name = owner.name_map.get(name, name)
        owner = owner.wrapped
    return name if isinstance(owner, NativeMCPToolset) else None


def server_name(server: NativeMCPToolset[Any]) -> str:
    """A name of the server that is the same in every process (its ``label`` may hold
    an object's address): ``known_name``, else ``"mcp"``."""
    return known_name(server) or "mcp"


def known_name(server: NativeMCPToolset[Any]) -> str | None:
    """The server's ``id``, else the name it gave at initialization, else ``None``:
    what tells a connection to it from one to another server (``ServerReadBack``)."""
    if server.id:
        return server.id
    with contextlib.suppress(AttributeError):
        return server.server_info.name
    return None
