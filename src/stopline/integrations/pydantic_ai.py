"""Pydantic AI: each call of a side-effecting tool is a stopline operation.

    from stopline.integrations import pydantic_ai as sl

    agent = Agent(model, toolsets=[sl.gated(FunctionToolset([refund, lookup]),
                                            reads={"lookup"})])
    async with sl.run(ledger, owner="user:42", run_id="refund-1042") as s:
        result = await s.run(agent, "refund order 1042")
    receipt = await s.cancel(by="user:42")        # from another task

What Pydantic AI does on its own (``shared/notes/peers.md``): ``RunCancelled``
is raised and async tools are cancelled, but a sync tool goes on in its
executor thread and commits later, and the history shows the call without a
return. Here:

- ``gated(toolset)`` wraps any toolset (a ``WrapperToolset``): each call passes
  the dispatch gate under ``tool:<tool_call_id>`` (the model's id), so a retry
  of the same call returns the recorded result. Tools named in ``reads`` skip
  the gate (no effects);
- ``s.cancel`` fences the run first (R1), then cancels the agent run through
  its ``CancellationToken`` (Pydantic AI's own run cancellation);
- a sync tool's call runs to its end in the ledger's task group: the
  operation is ``unknown`` when the run is cancelled, then ``committed`` with
  the late result (R4); an interrupted async tool is ``unknown`` until
  verified (``verify={name: fn}`` reads the destination back by key);
- resume: ``s.cancelled.all_messages()`` is what Pydantic AI kept; pass it
  through ``s.history(...)``, which adds the recorded result of every call that
  committed but has no return, so the model does not ask for it again;
- MCP tools: ``mcp_toolset(conn)`` is a toolset of the tools a ``StoplineMCP``
  connection lists; each call is ``conn.call(run, name, args, key=tool:<tool_call_id>)``
  (the idempotency key in ``_meta``, late answers kept, verified through the
  server's ``stopline_verify``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic_ai import CancellationToken
from pydantic_ai.exceptions import RunCancelled as AgentRunCancelled
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.tools import RunContext, ToolDefinition
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset
from pydantic_ai.toolsets.external import TOOL_SCHEMA_VALIDATOR

from stopline.domain.vocab import OpStatus, Policy
from stopline.errors import NotFound, RunFenced
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

__all__ = [
    "AgentSession",
    "MCPToolset",
    "NoRun",
    "StoplineToolset",
    "gated",
    "history_key",
    "mcp_toolset",
    "run",
]

# the framework's own call, handed from ``call_tool`` to the gated tool beside the
# arguments (they are the operation's digest; the run context is not)
_CALL: contextvars.ContextVar[tuple[RunContext[Any], ToolsetTool[Any]] | None] = (
    contextvars.ContextVar("stopline_pydantic_ai_call", default=None)
)


def history_key(tool_call_id: str) -> str:
    """The operation key of a tool call (``<run id>/<key>`` is its id)."""
    return f"tool:{tool_call_id}"


@dataclasses.dataclass
class StoplineToolset(WrapperToolset[Any]):
    """A toolset whose side-effecting calls pass the stopline gate."""

    reads: Collection[str] = ()
    verify: Mapping[str, VerifyByKey] = dataclasses.field(default_factory=dict)
    _tools: dict[tuple[str, bool], Tool[Any]] = dataclasses.field(default_factory=dict)

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        if name in self.reads:
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        gated_tool = self._tool_for(name, tool)
        key = history_key(ctx.tool_call_id) if ctx.tool_call_id else None
        token = _CALL.set((ctx, tool))
        try:
            return await gated_call(gated_tool, key, tool_args)
        finally:
            _CALL.reset(token)

    def _tool_for(self, name: str, tool: ToolsetTool[Any]) -> Tool[Any]:
        is_async = bool(getattr(tool, "is_async", True))
        found = self._tools.get((name, is_async))
        if found is not None:
            return found
        spec = ToolSpec(verify=self.verify.get(name))  # the receipt names it by its tool name
        if is_async:  # a cancel interrupts it: unknown until verified
            made: Tool[Any] = Tool(self._direct(name), name=name, description=spec.description)
            made.wants_context = True
            verify = spec.verify
            if verify is not None:

                async def read_back(ctx: CallContext) -> Any:
                    return await verify(ctx.key)

                made.verify_fn = read_back
        else:  # a def tool: its executor thread finishes whoever waits (R4)
            made = detached_tool(name, spec, self._framework_call(name))
        self._tools[(name, is_async)] = made
        return made

    def _direct(self, name: str) -> Any:
        async def call(ctx: CallContext, tool_args: dict[str, Any]) -> Any:
            return await self._framework_call(name)(ctx, (tool_args,), {})()

        return call

    def _framework_call(self, name: str) -> Any:
        def start(ctx: CallContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
            call = _CALL.get()
            assert call is not None, "called outside StoplineToolset.call_tool"
            run_ctx, tool = call
            (tool_args,) = args
            return lambda: self.wrapped.call_tool(name, tool_args, run_ctx, tool)

        return start


def gated(
    toolset: AbstractToolset[Any],
    *,
    reads: Collection[str] = (),
    verify: Mapping[str, VerifyByKey] | None = None,
) -> StoplineToolset:
    """Wrap a toolset: calls of its tools (except ``reads``) pass the gate."""
    return StoplineToolset(toolset, reads=frozenset(reads), verify=dict(verify or {}))


class MCPToolset(AbstractToolset[Any]):
    """The tools of an MCP server, called through ``StoplineMCP`` in the current run."""

    def __init__(
        self,
        conn: StoplineMCP,
        *,
        include: Collection[str] | None = None,
        exclude: Collection[str] = (),
        timeout: float | None = None,
        id: str | None = None,
    ) -> None:
        from stopline.integrations.mcp import VERIFY_TOOL  # the extra is needed only here

        self.conn = conn
        self.include = None if include is None else frozenset(include)
        self.exclude = frozenset({VERIFY_TOOL, *exclude})  # stopline's read-back, not the model's
        self.timeout = timeout
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
        return await mcp_call(self.conn, name, tool_args, key, timeout=self.timeout)


def mcp_toolset(
    conn: StoplineMCP,
    *,
    include: Collection[str] | None = None,
    exclude: Collection[str] = (),
    timeout: float | None = None,
) -> MCPToolset:
    """A toolset of ``conn``'s tools (``include``/``exclude`` by name); calls pass the gate."""
    return MCPToolset(conn, include=include, exclude=exclude, timeout=timeout)


class AgentSession:
    """One stopline run carrying Pydantic AI agent runs."""

    def __init__(self, bound: Bound) -> None:
        self.bound = bound
        self.id = bound.run.id
        self.cancelled: AgentRunCancelled | None = None  # what Pydantic AI kept, for resume
        self._token: CancellationToken | None = None
        bound.interrupt = self._interrupt

    async def run(self, agent: Any, user_prompt: Any = None, **kwargs: Any) -> Any:
        """``agent.run(...)`` under this run; a cancel ends it and the run's block quietly."""
        token = self._token = CancellationToken()
        if self.bound.run.cancel_requested:
            token.cancel()
        try:
            return await agent.run(user_prompt, cancellation_token=token, **kwargs)
        except AgentRunCancelled as exc:
            self.cancelled = exc
            raise RunFenced(self.id) from exc
        finally:
            self._token = None

    async def cancel(self, *, by: str, reason: str = "") -> Any:
        """Fence the run, then cancel the agent run. Returns the receipt at the cancel."""
        return await self.bound.cancel(by=by, reason=reason)

    def _interrupt(self) -> None:
        if self._token is not None:
            self._token.cancel()

    async def history(self, messages: Sequence[ModelMessage]) -> list[ModelMessage]:
        """The messages with the recorded result of each committed call that has no return."""
        return await repair_history(self.bound.ledger, self.id, messages)


async def repair_history(
    ledger: Ledger, run_id: str, messages: Sequence[ModelMessage]
) -> list[ModelMessage]:
    """Add a return for every tool call that committed (per the ledger) but has none."""
    answered = {
        part.tool_call_id
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart | RetryPromptPart)
    }
    returns: list[ToolReturnPart] = []
    for message in messages:
        if not isinstance(message, ModelResponse):
            continue
        for part in message.parts:
            if not isinstance(part, ToolCallPart) or part.tool_call_id in answered:
                continue
            try:
                op = await ledger.backend.get_operation(
                    f"{run_id}/{history_key(part.tool_call_id)}"
                )
            except NotFound:
                continue
            if op.status in (OpStatus.COMMITTED, OpStatus.COMPENSATING, OpStatus.COMPENSATED):
                returns.append(ToolReturnPart(part.tool_name, op.result, part.tool_call_id))
    out = list(messages)
    if not returns:
        return out
    if out and isinstance(out[-1], ModelRequest):
        last = out[-1]
        out[-1] = dataclasses.replace(last, parts=[*last.parts, *returns])
    else:
        out.append(ModelRequest(parts=returns))
    return out


@contextlib.asynccontextmanager
async def run(
    ledger: Ledger,
    *,
    owner: str,
    name: str = "pydantic-ai",
    run_id: str | None = None,
    tenant: str = "default",
    policy: Policy = Policy.VERIFY,
) -> AsyncIterator[AgentSession]:
    """A stopline run bound to gated tools called in this context."""
    async with ledger.run(name, owner=owner, tenant=tenant, run_id=run_id, policy=policy) as r:
        session = AgentSession(Bound(ledger, r))
        with bind(session.bound):
            yield session
