"""OpenAI Agents SDK: each call of a side-effecting function tool is a stopline operation.

    from stopline.integrations import openai_agents as sl

    agent = Agent(name="support", tools=[sl.gated(refund), lookup])
    async with sl.run(ledger, owner="user:42", run_id="refund-1042") as s:
        result = s.run_streamed(agent, "refund order 1042")
        async for event in result.stream_events(): ...
    receipt = await s.cancel(by="user:42")        # from another task

What the SDK does on its own (``shared/notes/peers.md``):
``RunResultStreaming.cancel(mode="immediate")`` keeps no record of the tool
calls in flight, while a sync tool goes on in its thread and commits. Here:

- ``gated(function_tool)`` wraps a ``FunctionTool``: each call passes the
  dispatch gate under ``tool:<call_id>`` (the model's ``call_id``, which a
  ``RunState`` keeps), so a retry or a resume from the state returns the
  recorded result instead of a second effect;
- ``s.cancel`` fences the run first (R1), then calls the SDK's own
  ``RunResultStreaming.cancel(mode="immediate")``;
- a sync tool's call runs to its end in the ledger's task group: it is
  ``unknown`` when the run is cancelled, then ``committed`` with the late result
  (R4); an interrupted async tool is ``unknown`` until verified
  (``gated(tool, verify=fn)`` reads the destination back by key);
- resume: ``result.to_state()`` then ``s.run_streamed(agent, state)`` in a new
  ``sl.run`` with the same run id (after ``ledger.resume``);
- MCP tools: ``mcp_tools(conn)`` turns the tools a ``StoplineMCP`` connection
  lists into ``FunctionTool`` objects whose calls are ``conn.call`` under
  ``tool:<call_id>`` (the idempotency key in ``_meta``, late answers kept,
  verified through the server's ``stopline_verify``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
from collections.abc import AsyncIterator, Collection
from typing import TYPE_CHECKING, Any

from agents import FunctionTool, Runner
from agents import Tool as AgentsTool
from agents import tool as agents_tool
from agents.result import RunResultStreaming
from agents.tool_context import ToolContext

from stopline.domain.vocab import Policy
from stopline.errors import RunFenced
from stopline.integrations._frameworks import (
    Bound,
    NoRun,
    ToolSpec,
    VerifyByKey,
    Work,
    bind,
    detached_tool,
    gated_call,
    mcp_call,
)
from stopline.runtime.context import CallContext
from stopline.runtime.ledger import Ledger
from stopline.runtime.tool import Tool

if TYPE_CHECKING:
    from stopline.integrations.mcp import StoplineMCP

__all__ = ["AgentSession", "NoRun", "gated", "mcp_tools", "run"]

# the SDK's tool context, handed to the gated tool beside the arguments (the JSON
# input is the operation's digest; the context is not)
_CALL: contextvars.ContextVar[ToolContext[Any] | None] = contextvars.ContextVar(
    "stopline_openai_agents_call", default=None
)


def gated(tool: FunctionTool, *, verify: VerifyByKey | None = None) -> FunctionTool:
    """The same function tool, its calls passing the stopline gate under ``tool:<call_id>``."""
    invoke = tool.on_invoke_tool
    spec = ToolSpec(verify=verify)  # the receipt names it by its tool name

    def start(ctx: CallContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        tool_ctx = _CALL.get()
        assert tool_ctx is not None, "called outside the gated tool"
        (arguments,) = args
        return lambda: invoke(tool_ctx, arguments)

    if _runs_in_thread(tool):  # the SDK runs it in a thread: let it finish, keep its answer
        stopline_tool = detached_tool(tool.name, spec, start)
    else:  # a cancel interrupts it: unknown until verified

        async def direct(ctx: CallContext, arguments: str) -> Any:
            return await start(ctx, (arguments,), {})()

        stopline_tool = Tool(direct, name=tool.name, description=spec.description)
        stopline_tool.wants_context = True
        if verify is not None:

            async def read_back(ctx: CallContext) -> Any:
                return await verify(ctx.key)

            stopline_tool.verify_fn = read_back

    async def on_invoke_tool(ctx: ToolContext[Any], arguments: str) -> Any:
        token = _CALL.set(ctx)
        try:
            return await gated_call(stopline_tool, f"tool:{ctx.tool_call_id}", arguments)
        finally:
            _CALL.reset(token)

    return dataclasses.replace(tool, on_invoke_tool=on_invoke_tool)


def mcp_tools(
    conn: StoplineMCP,
    *,
    include: Collection[str] | None = None,
    exclude: Collection[str] = (),
    timeout: float | None = None,
) -> list[AgentsTool]:
    """Function tools for the tools ``conn`` lists (``include``/``exclude`` by name).

    Each call is ``conn.call`` in the current stopline run under ``tool:<call_id>``;
    it runs beside the SDK's task, so ``cancel(mode="immediate")`` does not cut it
    halfway through stopline's cancel (the run's policy decides). A JSON-object
    result is handed to the model as JSON.
    """
    from stopline.integrations.mcp import VERIFY_TOOL  # the extra is needed only here

    skip = {VERIFY_TOOL, *exclude}  # stopline's read-back, not the model's
    return [
        _mcp_tool(
            conn, name, listed.description or listed.title or name, listed.input_schema, timeout
        )
        for name, listed in conn.listing.items()
        if name not in skip and (include is None or name in include)
    ]


def _mcp_tool(
    conn: StoplineMCP, name: str, description: str, schema: dict[str, Any], timeout: float | None
) -> FunctionTool:
    async def on_invoke_tool(ctx: ToolContext[Any], arguments: str) -> Any:
        args = json.loads(arguments) if arguments else {}
        result = await mcp_call(conn, name, args, f"tool:{ctx.tool_call_id}", timeout=timeout)
        return result if isinstance(result, str) else json.dumps(result)

    return FunctionTool(
        name=name,
        description=description,
        params_json_schema=dict(schema),
        on_invoke_tool=on_invoke_tool,
        strict_json_schema=False,  # MCP input schemas are not strict JSON schemas
    )


def _runs_in_thread(tool: FunctionTool) -> bool:
    """The SDK marks the invoker of a ``def`` tool (it runs it with ``asyncio.to_thread``)."""
    marker = getattr(agents_tool, "_SYNC_FUNCTION_TOOL_MARKER", "")  # private in 0.24
    return bool(marker) and bool(getattr(tool.on_invoke_tool, marker, False))


class AgentSession:
    """One stopline run carrying Agents SDK runs."""

    def __init__(self, bound: Bound) -> None:
        self.bound = bound
        self.id = bound.run.id
        self.result: RunResultStreaming | None = None
        bound.interrupt = self._interrupt

    def run_streamed(self, agent: Any, run_input: Any, **kwargs: Any) -> RunResultStreaming:
        """``Runner.run_streamed`` under this run (its tool calls pass the gate)."""
        self.result = Runner.run_streamed(agent, run_input, **kwargs)
        if self.bound.run.cancel_requested:
            self.result.cancel(mode="immediate")
        return self.result

    async def stream(self, agent: Any, run_input: Any, **kwargs: Any) -> RunResultStreaming:
        """Run to the end, consuming the events; a cancel ends the run's block quietly."""
        result = self.run_streamed(agent, run_input, **kwargs)
        async for _ in result.stream_events():
            pass
        if self.bound.run.cancel_requested:
            raise RunFenced(self.id)
        return result

    async def cancel(self, *, by: str, reason: str = "") -> Any:
        """Fence the run, then ``RunResultStreaming.cancel``. Returns the receipt at the cancel."""
        return await self.bound.cancel(by=by, reason=reason)

    def _interrupt(self) -> None:
        if self.result is not None:
            self.result.cancel(mode="immediate")


@contextlib.asynccontextmanager
async def run(
    ledger: Ledger,
    *,
    owner: str,
    name: str = "openai-agents",
    run_id: str | None = None,
    tenant: str = "default",
    policy: Policy = Policy.VERIFY,
) -> AsyncIterator[AgentSession]:
    """A stopline run bound to gated tools called in this context."""
    async with ledger.run(name, owner=owner, tenant=tenant, run_id=run_id, policy=policy) as r:
        session = AgentSession(Bound(ledger, r))
        with bind(session.bound):
            yield session
