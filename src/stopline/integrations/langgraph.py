"""LangGraph: side-effecting nodes and tools as stopline operations.

    from stopline.integrations import langgraph as sl

    @sl.node                      # a node whose body is one side effect
    def refund(state: State) -> dict[str, str]: ...

    tools = ToolNode([sl.tool(send_email)])   # each call of the tool is gated

    async with sl.run(ledger, owner="user:42", thread_id="t-1") as g:
        await g.ainvoke(graph, {"order": "1042"})
    receipt = await g.cancel(by="user:42")     # from another task

What LangGraph does on its own (``shared/notes/peers.md``): a cancelled task is
saved as an error and re-run on resume, so a sync node that committed after the
cancel commits again. Here:

- each gated node's body passes the dispatch gate under a key derived from its
  LangGraph task (``langgraph_checkpoint_ns``: node name and task id, which
  LangGraph derives from the checkpoint, so a resume from that checkpoint
  reaches the same key); each gated tool's call under ``tool:<tool_call_id>``
  (the model's id, kept in the checkpointed messages). A resume therefore gets
  the recorded result of what already committed instead of a second effect;
- ``g.cancel`` fences the run first (R1), then cancels the graph's execution
  (LangGraph's task cancellation); a sync node or tool still running in its
  worker thread is recorded ``unknown`` and then ``committed`` when it returns
  (R4, ``stopline.integrations._frameworks``);
- resuming: ``ledger.resume(run_id, ...)`` then ``g.ainvoke(graph, None)`` in a
  new ``sl.run`` with the same thread id (LangGraph continues from its
  checkpoint; stopline replays what committed).

Node results are replayed from the ledger, so they should be JSON-able (a
state update of plain values); a result that is not is replayed as ``None``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncIterator, Callable, Collection
from typing import TYPE_CHECKING, Any, TypeVar, overload

import anyio
from langchain_core.messages import ToolCall
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, StructuredTool
from langchain_core.tools import tool as lc_tool

from stopline.domain.vocab import Cancellable
from stopline.errors import RunFenced
from stopline.integrations._frameworks import (
    Bound,
    NoRun,
    ToolSpec,
    VerifyByKey,
    bind,
    gated_call,
    mcp_call,
    stopline_tool,
)
from stopline.runtime.ledger import Ledger

if TYPE_CHECKING:
    from stopline.integrations.mcp import StoplineMCP
from stopline.runtime.tool import Tool

__all__ = ["GraphRun", "NoRun", "mcp_tools", "node", "run", "tool"]

F = TypeVar("F", bound=Callable[..., Any] | Tool[Any])

_TOOL_CALL: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "stopline_langgraph_tool_call", default=None
)


class GraphRun:
    """One stopline run carrying LangGraph invocations on one thread."""

    def __init__(self, bound: Bound, thread_id: str) -> None:
        self.bound = bound
        self.thread_id = thread_id
        self.id = bound.run.id
        self._scope: anyio.CancelScope | None = None
        bound.interrupt = self._interrupt

    @property
    def config(self) -> RunnableConfig:
        """The graph config naming this thread (checkpoints are kept per thread)."""
        return {"configurable": {"thread_id": self.thread_id}}

    async def ainvoke(
        self, graph: Any, graph_input: Any, config: RunnableConfig | None = None
    ) -> Any:
        """``graph.ainvoke`` on this thread; a cancel ends it and the run's block quietly."""
        merged: dict[str, Any] = dict(config or {})
        merged["configurable"] = {
            **dict(merged.get("configurable") or {}),
            **self.config["configurable"],
        }
        with anyio.CancelScope() as scope:
            self._scope = scope
            if self.bound.run.cancel_requested:
                scope.cancel()
            try:
                return await graph.ainvoke(graph_input, merged)
            finally:
                self._scope = None
        raise RunFenced(self.id)  # the graph was cancelled: leave the run's block

    async def cancel(self, *, by: str, reason: str = "") -> Any:
        """Fence the run, then cancel the graph. Returns the receipt at the cancel."""
        return await self.bound.cancel(by=by, reason=reason)

    def _interrupt(self) -> None:
        if self._scope is not None:
            self._scope.cancel()


@contextlib.asynccontextmanager
async def run(
    ledger: Ledger,
    *,
    owner: str,
    thread_id: str,
    name: str = "langgraph",
    run_id: str | None = None,
    tenant: str = "default",
) -> AsyncIterator[GraphRun]:
    """A stopline run (by default its id is the thread id) bound to the graph's tools."""
    async with ledger.run(name, owner=owner, tenant=tenant, run_id=run_id or thread_id) as r:
        graph_run = GraphRun(Bound(ledger, r), thread_id)
        with bind(graph_run.bound):
            yield graph_run


def _task_key() -> str | None:
    """The running LangGraph task's namespace (``node:task_id``), if any."""
    from langgraph.config import get_config

    try:
        metadata = get_config().get("metadata") or {}
    except RuntimeError:
        return None
    ns = metadata.get("langgraph_checkpoint_ns")
    return str(ns) if ns else None


@overload
def node(fn: F, /) -> Callable[..., Any]: ...


@overload
def node(
    *, name: str | None = None, description: str = "", verify: VerifyByKey | None = None
) -> Callable[[F], Callable[..., Any]]: ...


def node(
    fn: F | None = None,
    /,
    *,
    name: str | None = None,
    description: str = "",
    verify: VerifyByKey | None = None,
) -> Callable[..., Any]:
    """A graph node whose body is one side effect, gated and keyed by its task.

    The wrapped node is async (LangGraph awaits it); a ``def`` body runs in a
    worker thread the adapter owns. ``verify(key)`` reads the destination back.
    """

    def wrap(f: F) -> Callable[..., Any]:
        label = name or (f.name if isinstance(f, Tool) else f.__name__)
        t = stopline_tool(f, label, ToolSpec(description=description, verify=verify))

        async def gated_node(state: Any) -> Any:
            return await gated_call(t, _task_key(), state)

        gated_node.__name__ = gated_node.__qualname__ = label
        gated_node.__doc__ = f.__doc__
        return gated_node

    return wrap(fn) if fn is not None else wrap


class _GatedTool(StructuredTool):
    """A LangChain tool whose calls learn their ``tool_call_id`` before running."""

    async def ainvoke(
        self,
        input: str | dict[str, Any] | ToolCall,
        config: RunnableConfig | None = None,
        **kwargs: Any,
    ) -> Any:
        call_id = input.get("id") if isinstance(input, dict) else None
        token = _TOOL_CALL.set(str(call_id) if call_id else None)
        try:
            return await super().ainvoke(input, config, **kwargs)
        finally:
            _TOOL_CALL.reset(token)


def tool(
    fn: Callable[..., Any] | BaseTool,
    *,
    effects: bool = True,
    cancellable: Cancellable = Cancellable.NEVER,
    verify: VerifyByKey | None = None,
) -> BaseTool:
    """A LangChain tool (for ``ToolNode`` and prebuilt agents) whose calls are gated.

    Give it a function (its signature and docstring make the tool's schema) or a
    ``StructuredTool``. Each call is an operation keyed ``tool:<tool_call_id>``.
    """
    base = fn if isinstance(fn, BaseTool) else lc_tool(fn)
    if not isinstance(base, StructuredTool):
        raise TypeError(f"tool() wraps functions and StructuredTools, not {type(base).__name__}")
    body = base.coroutine or base.func
    if body is None:
        raise TypeError(f"tool {base.name!r} has no function to wrap")
    spec = ToolSpec(effects=effects, cancellable=cancellable, verify=verify)
    t = stopline_tool(body, base.name, spec)

    async def call(**kwargs: Any) -> Any:
        call_id = _TOOL_CALL.get()
        return await gated_call(t, f"tool:{call_id}" if call_id else None, **kwargs)

    return _GatedTool(
        name=base.name,
        description=base.description,
        args_schema=base.args_schema,
        coroutine=call,
        response_format=base.response_format,
    )


def mcp_tools(
    conn: StoplineMCP,
    *,
    include: Collection[str] | None = None,
    exclude: Collection[str] = (),
    timeout: float | None = None,
) -> list[BaseTool]:
    """LangChain tools (for ``ToolNode``) for the tools ``conn`` lists.

    Each call is ``conn.call`` in the current stopline run under
    ``tool:<tool_call_id>``, beside the graph's task: a cancel of the graph stops
    the waiting, and the run's policy decides what happens to the call.
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
) -> BaseTool:
    async def call(**kwargs: Any) -> Any:
        call_id = _TOOL_CALL.get()
        key = f"tool:{call_id}" if call_id else None
        return await mcp_call(conn, name, kwargs, key, timeout=timeout)

    return _GatedTool(name=name, description=description, args_schema=dict(schema), coroutine=call)
