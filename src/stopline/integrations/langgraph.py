"""LangGraph: side-effecting nodes and tools as stopline operations.

    from stopline.integrations import langgraph as sl

    @sl.node                      # a node whose body is one side effect
    def refund(state: State) -> dict[str, str]: ...

    tools = ToolNode([send_email, lookup], awrap_tool_call=sl.gate(reads={"lookup"}))

    async with sl.run(ledger, owner="user:42", thread_id="t-1") as g:
        await g.ainvoke(graph, {"order": "1042"})
    receipt = await g.cancel(by="user:42")     # from another task

What LangGraph does on its own (``shared/notes/peers.md``): a cancelled task is
saved as an error and re-run on resume, so a sync node that committed after the
cancel commits again. Here:

- ``sl.gate(...)`` is a ``ToolNode(awrap_tool_call=...)`` hook: every tool call of
  the node passes the dispatch gate under ``tool:<tool_call_id>`` (the model's id,
  kept in the checkpointed messages), whatever the tool; ``reads`` skip it. A
  tool that raises is recorded (``unknown``) before ``ToolNode`` turns the error
  into a message. Each gated node's body passes the gate under a key derived
  from its LangGraph task (``langgraph_checkpoint_ns``: node name and task id,
  which LangGraph derives from the checkpoint). A resume therefore gets the
  recorded result of what already committed instead of a second effect;
- ``interrupt()`` inside a gated tool is a pause, not a failure: the attempt is
  recorded ``not_committed`` (LangGraph re-runs the tool from its start on
  resume, so what comes before ``interrupt()`` must have no effect: LangGraph's
  own rule), and the stopline run is paused with an approval request for the
  call. In an ``sl.node`` body it is a pause too (ADR 0094): ``not_committed``,
  the run paused with no approval asked (a node's question is the graph's own),
  and the node's re-run on resume passes the gate under the same task key. A
  graph stopped at a breakpoint before a tool node (``interrupt_before``)
  pauses the run the same way, one approval request per pending tool call;
  after ``ledger.approve`` and ``ledger.resume``, ``g.ainvoke(graph,
  Command(resume=...))`` (or ``None``) on the same thread runs them, each
  passing the gate only with its approval granted. The same holds for an
  ``sl.tool`` (ADR 0101). A ``ParentCommand`` out of a gated tool or node (a
  graph it ran handed a command up) is no pause: the call ran to its end, and is
  recorded ``committed`` with its command, which a replay raises again;
- ``g.cancel`` fences the run first (R1), then cancels the graph's execution
  (LangGraph's task cancellation); cancelling the task that runs the graph is a
  stopline cancel too. A sync node or tool still running in its worker thread is
  recorded ``unknown`` and then ``committed`` when it returns (R4);
- resuming: ``ledger.resume(run_id, ...)`` then ``g.ainvoke(graph, None)`` in a
  new ``sl.run`` with the same thread id (LangGraph continues from its
  checkpoint; stopline replays what committed);
- a thread outlives its run (ADR 0107, ``_langgraph_thread``): ``sl.run`` on a
  thread whose run ended ``completed`` (a new message) or ``failed`` (LangGraph's
  retry, ``ainvoke(None)``, which runs the failed superstep's calls again, those
  that committed too) opens the thread's next run, ``THREAD@turn:N``, and a call
  an earlier run of the thread recorded is answered from that record: happened,
  replayed and not sent; in doubt, read back first (R5), then replayed, sent or
  refused (nothing sent); not happened, sent in the new run. A run of the thread
  that was cancelled, is in review or paused is entered again once resumed (R10).
  A repeat under a new id of a call an earlier run left without its answer for the
  model is that call, settled since or not (answered once, then noted; ADR 0120);
  two entries of one thread at once: one enters, the other is told to retry
  (``LedgerLocked``, ``_langgraph_entry``; ADR 0112); a turn whose run another
  entry ended under it raises ``RunEnded`` saying so, never a quiet end (ADR 0120).

Node and tool results are replayed from the ledger: JSON as it is; a ``Command``
or an update JSON cannot write (messages) as LangGraph's serializer writes it
(``_langgraph_calls.kept``, ADR 0097), so a replay returns an equal value (a
record it cannot read back: as one not kept, ADR 0101). A
tool call that runs returns its own ``ToolMessage`` (its ``artifact``,
``additional_kwargs`` and ``response_metadata`` kept); the ledger records its
content only, so a replayed call's message is rebuilt from that content. A
replayed tool call whose result was not kept answers with a note saying so; a
replayed node whose record holds no update (not kept, or proved by a read-back)
raises ``NotReplayable`` (``update_of``), never an empty update.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, overload

import anyio
from langchain_core.messages import AIMessage, ToolCall
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, StructuredTool
from langchain_core.tools import tool as lc_tool
from langgraph.prebuilt.tool_node import ToolCallRequest

from stopline.domain.vocab import Cancellable, Policy
from stopline.errors import RunEnded, RunFenced, UnknownOperation
from stopline.integrations._frameworks import (
    Bound,
    NoRun,
    ToolSpec,
    VerifyByKey,
    as_verifier,
    current,
    gated_call,
    mcp_call,
    mcp_offered,
    open_run,
    stopline_tool,
)
from stopline.integrations._langchain_tools import fits, refusing
from stopline.integrations._langgraph_calls import (
    GatedBaseTool,
    bubbled,
    gated_message,
    keeping,
    op_id_of,
    pausing,
    replayed,
    restored,
    update_of,
)
from stopline.integrations._langgraph_entry import entered
from stopline.integrations._langgraph_thread import OVER, Thread, answer, for_model, remember
from stopline.integrations._renamed import renamed_idle_timeout
from stopline.ledger.backend import RunSpec
from stopline.runtime.ledger import Ledger

if TYPE_CHECKING:
    from stopline.integrations.mcp import StoplineMCP
from stopline.runtime.tool import CancelFn, Tool, Verifier

__all__ = ["GraphRun", "NoRun", "gate", "mcp_tools", "node", "run", "tool"]

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
        self.interrupted: list[str] = []  # keys of gated calls that called interrupt()
        bound.interrupt = self._interrupt

    @property
    def config(self) -> RunnableConfig:
        """The graph config naming this thread (checkpoints are kept per thread)."""
        return {"configurable": {"thread_id": self.thread_id}}

    async def ainvoke(
        self, graph: Any, graph_input: Any, config: RunnableConfig | None = None
    ) -> Any:
        """``graph.ainvoke`` on this thread; a cancel ends it and the run's block quietly.

        A graph that stops to wait (``interrupt()``, a breakpoint) pauses the run.
        """
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
                async with self.bound.native_cancels():
                    result = await graph.ainvoke(graph_input, merged)
            except RunFenced as fenced:  # refused at the gate: cancelled, or ended under it
                if fenced.run_id == self.id:
                    await self._ended_under()
                raise
            finally:
                self._scope = None
            await self._pause_if_waiting(graph, merged)
            return result
        await self._ended_under()
        raise RunFenced(self.id)  # the graph was cancelled: leave the run's block

    async def _ended_under(self) -> None:
        """The graph was stopped at the gate, and no cancel did it: another entry of the
        thread in the same run (another worker) ended the run under this one. Said, as
        ``RunEnded``, not a quiet end of the block (ADR 0120): the turn was cut."""
        record = await self.bound.ledger.backend.get_run(self.id)
        if record.state in OVER and record.cancelled_by is None:
            raise RunEnded(
                self.id,
                record.state,
                f"it was ended by another entry of thread {self.thread_id!r} (another "
                "worker in the same run at once) while this one was in it: this turn was "
                "cut at its next gated call, which was not sent; enter the thread again "
                "(sl.run) to go on in its next run",
            )

    async def _pause_if_waiting(self, graph: Any, config: Any) -> None:
        """The graph stopped before its end (an interrupt, a breakpoint): pause the run,
        asking approval for the tool calls it waits on."""
        if getattr(graph, "checkpointer", None) is None:
            return  # no checkpoints: nothing to resume from, nothing to wait on
        snapshot = await graph.aget_state(config)
        if not snapshot.next:
            return
        keys = list(self.interrupted)
        if not keys:  # a breakpoint: the tool calls of the last model message
            messages = (snapshot.values or {}).get("messages", [])
            last = messages[-1] if messages else None
            if isinstance(last, AIMessage):
                keys = [f"tool:{call['id']}" for call in last.tool_calls if call.get("id")]
        await self.bound.suspend(keys, f"waiting at {', '.join(snapshot.next)}")

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
    policy: Policy = Policy.VERIFY,
    approver: str | None = None,
) -> AsyncIterator[GraphRun]:
    """A stopline run of the thread bound to the graph's tools: the thread's run (by
    default its id is the thread id), or, once that ended ``completed`` or ``failed``,
    the thread's next one (``ID@turn:2`` ...), whose calls an earlier run recorded are
    answered from that record (``_langgraph_thread``, ADR 0107). Another entry of the
    thread in that run now: ``LedgerLocked``, retry once its turn ended (ADR 0112)."""
    made = RunSpec(id=run_id or thread_id, name=name, owner=owner, tenant=tenant, policy=policy)

    def opening(thread: Thread) -> contextlib.AbstractAsyncContextManager[GraphRun]:
        def session(bound: Bound) -> GraphRun:
            remember(bound, thread)
            return GraphRun(bound, thread_id)

        return open_run(
            ledger,
            session,
            name=name,
            owner=owner,
            run_id=thread.run_id,
            tenant=tenant,
            policy=policy,
            approver=approver,
        )

    async with contextlib.AsyncExitStack() as stack:  # another entry at once: ADR 0112
        yield await entered(stack, ledger, thread_id, made, opening)


_Execute = Callable[[ToolCallRequest], Awaitable[Any]]


def gate(
    *,
    reads: Collection[str] = (),
    verify: Mapping[str, Verifier | VerifyByKey] | None = None,
    cancel: Mapping[str, CancelFn] | None = None,
    settles_within: Mapping[str, float] | None = None,
) -> Callable[[ToolCallRequest, _Execute], Awaitable[Any]]:
    """A ``ToolNode(awrap_tool_call=...)`` hook: every tool call of the node is gated.

    Each call is an operation keyed ``tool:<tool_call_id>``; tools named in
    ``reads`` skip the gate; ``verify={name: async (ctx) -> ReadBack}`` reads a
    destination back by ``ctx.key``; ``cancel={name: async (ctx) -> bool | None}``
    asks an async tool's provider to cancel the call with that key (a cancel of
    the run asks every call in flight that has one); ``settles_within={name: s}``
    bounds when its effect may still land (R13). A ``def`` tool (any tool LangChain
    runs in an executor thread: ``@tool`` or ``Tool.from_function`` without a
    coroutine, a ``BaseTool`` with only ``_run``) runs to its end whoever stops
    waiting, and its result is attached when it returns (R4).
    """
    verify = dict(verify or {})
    cancel = dict(cancel or {})
    horizons = dict(settles_within or {})

    async def wrap(request: ToolCallRequest, execute: _Execute) -> Any:
        tool, call = request.tool, request.tool_call
        if tool is None or tool.name in reads or isinstance(tool, _GatedTool | GatedBaseTool):
            return await execute(request)  # a read, unknown, or gated by itself
        if not fits(tool, call["args"]):  # refused before it runs: no operation, no gate
            return await execute(request.override(tool=refusing(tool)))
        spec = ToolSpec(
            verify=as_verifier(verify.get(tool.name)),
            cancel=cancel.get(tool.name),
            settles_within=horizons.get(tool.name),
        )

        async def run_it() -> Any:
            return await execute(request)

        digest: tuple[tuple[Any, ...], dict[str, Any]] = ((call["args"],), {})
        return await gated_message(tool, call.get("id"), spec, run_it, digest, _paused)

    return wrap


def _paused(key: str) -> None:
    """The gated call ``key`` called ``interrupt()``: the graph waits on it."""
    session = current().session
    assert isinstance(session, GraphRun), "a gated LangGraph tool outside sl.run"
    session.interrupted.append(key)


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
    *,
    name: str | None = None,
    description: str = "",
    verify: Verifier | VerifyByKey | None = None,
    cancel: CancelFn | None = None,
    settles_within: float | None = None,
) -> Callable[[F], Callable[..., Any]]: ...


def node(
    fn: F | None = None,
    /,
    *,
    name: str | None = None,
    description: str = "",
    verify: Verifier | VerifyByKey | None = None,
    cancel: CancelFn | None = None,
    settles_within: float | None = None,
) -> Callable[..., Any]:
    """A graph node whose body is one side effect, gated and keyed by its task.

    The wrapped node is async (LangGraph awaits it); a ``def`` body runs in a
    worker thread the adapter owns. ``verify(ctx)`` reads the destination back;
    ``cancel(ctx)`` asks an async body's provider to cancel the call;
    ``settles_within`` bounds when its effect may still land (R13). ``interrupt()``
    in the body is a pause (``pausing``): the attempt is ``not_committed``, and the
    node's re-run on resume passes the gate under the same task key.
    """
    verifier = as_verifier(verify)

    def wrap(f: F) -> Callable[..., Any]:
        label = name or (f.name if isinstance(f, Tool) else f.__name__)
        spec = ToolSpec(
            description=description, verify=verifier, cancel=cancel, settles_within=settles_within
        )
        # a Command or an update JSON cannot write: kept as LangGraph writes it
        t = stopline_tool(f if isinstance(f, Tool) else keeping(pausing(f)), label, spec)

        async def gated_node(state: Any) -> Any:
            # a state update cannot be a sentence: a result not kept raises NotReplayable
            key = _task_key()
            earlier = await answer(t, key, (state,), {})  # an earlier run's record of it
            if earlier is not None:  # it happened: replayed, not sent
                return restored(update_of(earlier), earlier.id)
            with bubbled():  # interrupt(): recorded not committed, then LangGraph's pause
                result = await gated_call(t, state, key=key, unkept_as_text=False)
            op_id = op_id_of(current().run.id, key, label)
            if result is None and key is not None:  # replayed from a record with no update?
                with contextlib.suppress(UnknownOperation):  # (a repeat under another key)
                    result = update_of(await current().ledger.backend.get_operation(op_id))
            return restored(result, op_id)

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
    verify: Verifier | VerifyByKey | None = None,
    cancel: CancelFn | None = None,
    settles_within: float | None = None,
) -> BaseTool:
    """A LangChain tool (for ``ToolNode`` and prebuilt agents) whose calls are gated.

    Give it a function (its signature and docstring make the tool's schema), a
    ``StructuredTool``, or any other ``BaseTool`` (a subclass of yours,
    ``Tool.from_function``): that one runs as it is, through its own ``ainvoke``.
    Each call is an operation keyed ``tool:<tool_call_id>``, its arguments digested as
    keywords; ``verify(ctx)`` reads its destination back and ``cancel(ctx)`` asks its
    provider to cancel it, both by ``ctx.key``; ``settles_within`` bounds when its
    effect may still land (R13).
    """
    spec = ToolSpec(
        effects=effects,
        cancellable=cancellable,
        verify=as_verifier(verify),
        cancel=cancel,
        settles_within=settles_within,
    )
    if isinstance(fn, _GatedTool | GatedBaseTool):
        return fn  # gated already: one gate per call
    base = fn if isinstance(fn, BaseTool) else lc_tool(fn)
    body = (base.coroutine or base.func) if isinstance(base, StructuredTool) else None
    if not isinstance(base, StructuredTool) or body is None:
        # not a function's tool: the tool itself, through its own ainvoke
        return GatedBaseTool.over(base, spec, _paused)
    # a Command: kept as LangGraph writes it; interrupt(): a pause, as under ``gate``
    t = stopline_tool(keeping(pausing(body)), base.name, spec)

    async def call(**kwargs: Any) -> Any:
        call_id = _TOOL_CALL.get()
        key = f"tool:{call_id}" if call_id else None
        earlier = await answer(t, key, (), kwargs)  # an earlier run's record of it
        if earlier is not None:  # it happened: replayed, not sent
            return replayed(for_model(earlier, key), earlier.id, base.name)
        with bubbled(key, _paused):
            result = await gated_call(t, key=key, **kwargs)
        return replayed(result, op_id_of(current().run.id, key, base.name), base.name)

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
    idle_timeout: float | None = None,
    timeout: float | None = None,
) -> list[BaseTool]:
    """LangChain tools (for ``ToolNode``) for the tools ``conn`` lists.

    Each call is ``conn.call`` in the current stopline run under
    ``tool:<tool_call_id>``, beside the graph's task: a cancel of the graph stops
    the waiting, and the run's policy decides what happens to the call.
    """
    idle = renamed_idle_timeout("mcp_tools", idle_timeout, timeout)
    return [
        _mcp_tool(conn, name, description, schema, idle)
        for name, description, schema in mcp_offered(conn, include, exclude)
    ]


def _mcp_tool(
    conn: StoplineMCP, name: str, description: str, schema: dict[str, Any], idle: float | None
) -> BaseTool:
    async def call(**kwargs: Any) -> Any:
        call_id = _TOOL_CALL.get()
        key = f"tool:{call_id}" if call_id else None
        earlier = await answer(conn.tool(name), key, (kwargs,), {})  # as conn.call digests
        if earlier is not None:  # it happened in an earlier run of the thread: not sent
            return for_model(earlier, key)
        return await mcp_call(conn, name, kwargs, key=key, idle_timeout=idle)

    return _GatedTool(name=name, description=description, args_schema=dict(schema), coroutine=call)
