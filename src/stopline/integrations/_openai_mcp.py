"""OpenAI Agents SDK and MCP: the tools of a ``StoplineMCP`` connection as function
tools (``mcp_tools``), and what the gate adds to the SDK's own MCP servers.

Split from ``openai_agents`` (which re-exports ``mcp_tools``). A call of an MCP
server's tool carries its operation id in ``_meta["io.stopline/key"]``
(``_with_key``, the server's ``tool_meta_resolver``) and is read back through
the server's ``stopline_verify`` (``mcp_verify``), naming the tool as the server
knows it (``mcp_tool_name``). Its ``stopline_verify`` passes
no gate (nor do the tools the app names in ``reads``; a ``readOnlyHint`` alone is
untrusted, ADR 0055), and
``stopline_verify`` is not offered to the model (``offered``).
"""

from __future__ import annotations

import contextvars
import functools
import json
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from agents import FunctionTool
from agents import Tool as AgentsTool
from agents import tool as agents_tool
from agents.exceptions import ModelBehaviorError
from agents.mcp import MCPServer, MCPUtil
from agents.tool_context import ToolContext

from stopline.integrations._frameworks import mcp_call, mcp_offered, read_verify
from stopline.integrations._openai_arguments import json_object
from stopline.integrations._renamed import renamed_idle_timeout
from stopline.integrations.mcp import KEY_META, VERIFY_TOOL
from stopline.runtime.context import CallContext
from stopline.runtime.tool import ReadBack, Verdict

if TYPE_CHECKING:
    from stopline.integrations.mcp import StoplineMCP

__all__ = [
    "GATED",
    "OP_ID",
    "invoker_body",
    "key_in_meta",
    "mcp_server_of",
    "mcp_tool_name",
    "mcp_tools",
    "mcp_verify",
    "offered",
    "reads_only",
]

GATED = "__stopline_gated__"  # marks an invoker that passes the gate
# the operation id of the MCP call in progress, for its ``_meta`` (``_with_key``)
OP_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "stopline_openai_agents_op_id", default=None
)


def offered(tools: list[AgentsTool]) -> list[AgentsTool]:
    """An MCP server's tools as the model sees them: without ``stopline_verify``, under
    whatever name the SDK lists it (``include_server_in_tool_names``)."""
    return [t for t in tools if not (isinstance(t, FunctionTool) and reads_only(t))]


def reads_only(tool: FunctionTool) -> bool:
    """An MCP server's tool that passes no gate by what the server lists: its
    ``stopline_verify`` only (by the name the server knows it by). The SDK keeps a
    tool's annotations, not its ``_meta``, and a ``readOnlyHint`` alone is untrusted
    (ADR 0055): the app names its reads."""
    return (mcp_tool_name(invoker_body(tool)) or tool.name) == VERIFY_TOOL


def invoker_body(tool: FunctionTool) -> Any:
    """What a function tool's invoker runs: the SDK's error handling wraps it (0.24),
    and errors raised by the body are still raised here."""
    invoke = tool.on_invoke_tool
    return getattr(invoke, "_invoke_tool_impl", None) or invoke


def mcp_server_of(body: Any) -> MCPServer | None:
    """The server of an MCP tool the SDK built (``MCPUtil.invoke_mcp_tool`` bound to it)."""
    if isinstance(body, functools.partial) and body.func == MCPUtil.invoke_mcp_tool:
        server = body.args[0] if body.args else None
        return server if isinstance(server, MCPServer) else None
    return None


def key_in_meta(server: MCPServer) -> None:
    """Install ``_with_key`` as the server's ``tool_meta_resolver``, around its own (once)."""
    resolver = getattr(server, "tool_meta_resolver", None)
    if isinstance(resolver, functools.partial) and resolver.func is _with_key:
        return
    server.tool_meta_resolver = functools.partial(_with_key, resolver)


async def _with_key(user_resolver: Any, context: Any) -> dict[str, Any] | None:
    """The operation id in the request's ``_meta`` (the server's idempotency key)."""
    meta: dict[str, Any] = {}
    if user_resolver is not None:
        found = user_resolver(context)
        if hasattr(found, "__await__"):
            found = await found
        meta.update(found or {})
    op_id = OP_ID.get()
    if op_id:
        meta[KEY_META] = op_id
    return meta or None


def mcp_tool_name(body: Any) -> str | None:
    """The name the server knows an MCP tool the SDK built by (``MCPUtil.invoke_mcp_tool``
    bound to it): the SDK may list it under another (``include_server_in_tool_names``)."""
    if isinstance(body, functools.partial) and body.func == MCPUtil.invoke_mcp_tool:
        tool = body.args[1] if len(body.args) > 1 else None
        name = getattr(tool, "name", None)
        return name if isinstance(name, str) else None
    return None


async def mcp_verify(server: MCPServer, ctx: CallContext, tool: str | None = None) -> ReadBack:
    """The server's own record of the key (``stopline_verify``, ``read_verify``), when it
    offers one; ``tool``: the name the server knows the tool by (``mcp_tool_name``)."""

    async def verify(arguments: dict[str, Any]) -> Any:
        result = await server.call_tool(VERIFY_TOOL, arguments)
        return result.structured_content if not result.is_error else None

    try:
        tools = await server.list_tools()
    except Exception as exc:  # a read that failed proves nothing
        return ReadBack(Verdict.UNKNOWN, detail=f"{VERIFY_TOOL} failed: {exc}")
    return await read_verify(server.name, tools, verify, ctx, tool)


def mcp_tools(
    conn: StoplineMCP,
    *,
    include: Collection[str] | None = None,
    exclude: Collection[str] = (),
    idle_timeout: float | None = None,
    timeout: float | None = None,
) -> list[AgentsTool]:
    """Function tools for the tools ``conn`` lists (``include``/``exclude`` by name).

    Each call is ``conn.call`` in the current stopline run under ``tool:<call_id>``;
    it runs beside the SDK's task, so ``cancel(mode="immediate")`` does not cut it
    halfway through stopline's cancel (the run's policy decides). A JSON-object
    result is handed to the model as JSON.
    """
    idle = renamed_idle_timeout("mcp_tools", idle_timeout, timeout)
    return [
        _mcp_tool(conn, name, description, schema, idle)
        for name, description, schema in mcp_offered(conn, include, exclude)
    ]


def _mcp_tool(
    conn: StoplineMCP, name: str, description: str, schema: dict[str, Any], idle: float | None
) -> FunctionTool:
    async def on_invoke_tool(ctx: ToolContext[Any], arguments: str) -> Any:
        args = json_object(arguments)
        if args is None:  # no request can be made of it: no gate, told as the SDK tells
            return agents_tool.default_tool_error_function(ctx, ModelBehaviorError(arguments))
        key = f"tool:{ctx.tool_call_id}"
        result = await mcp_call(conn, name, args, key=key, idle_timeout=idle)
        return result if isinstance(result, str) else json.dumps(result)

    setattr(on_invoke_tool, GATED, True)  # StoplineMCP gates each call itself
    return FunctionTool(
        name=name,
        description=description,
        params_json_schema=dict(schema),
        on_invoke_tool=on_invoke_tool,
        strict_json_schema=False,  # MCP input schemas are not strict JSON schemas
    )
