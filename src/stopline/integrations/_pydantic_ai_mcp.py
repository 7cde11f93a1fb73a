"""Pydantic AI: the tools of a ``StoplineMCP`` connection as a toolset (``mcp_toolset``).

Split from ``pydantic_ai`` (which re-exports every name here): each call is
``conn.call`` in the bound run, keyed by the model's ``tool_call_id``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from pydantic_ai.tools import RunContext, ToolDefinition
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool
from pydantic_ai.toolsets.external import TOOL_SCHEMA_VALIDATOR

from stopline.integrations._frameworks import mcp_call
from stopline.integrations._renamed import renamed_idle_timeout

if TYPE_CHECKING:
    from stopline.integrations.mcp import StoplineMCP

__all__ = ["MCPToolset", "history_key", "mcp_toolset"]


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
