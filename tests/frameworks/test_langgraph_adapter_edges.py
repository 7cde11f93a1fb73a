"""LangGraph adapter: the edges a probe found (a tool raising a BaseException, the
fields of a tool's message, a ``def`` node's results held for ever).

Real graphs, real ``ToolNode``; real ledgers; barriers, never sleeps.
"""

from __future__ import annotations

import gc
import operator
import weakref
from typing import Annotated, Any, TypedDict

import anyio
import pytest
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.tools import BaseTool, StructuredTool, Tool, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode

import stopline
from stopline import OpStatus, RunState
from stopline.integrations import langgraph as sl
from stopline.integrations._langchain_tools import runs_in_thread

pytestmark = pytest.mark.timeout(30)


class Chat(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def tool_graph(tools: list[Any], calls: list[dict[str, Any]]) -> Any:
    """agent (asks for ``calls``) -> a gated ``ToolNode`` -> end."""

    async def agent(state: Chat) -> dict[str, Any]:
        return {"messages": [AIMessage("", tool_calls=calls)]}

    builder = StateGraph(Chat)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode(tools, awrap_tool_call=sl.gate()))
    builder.add_edge(START, "agent")
    builder.add_edge("agent", "tools")
    builder.add_edge("tools", END)
    return builder.compile(checkpointer=InMemorySaver())


def call(name: str, args: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"name": name, "args": args, "id": call_id, "type": "tool_call"}


class Halt(BaseException):
    """Not an ``Exception``: as ``SystemExit`` or ``KeyboardInterrupt`` would be."""


async def test_def_tool_raising_a_base_exception_fails_its_own_call_only(
    ledger: stopline.Ledger,
) -> None:
    other_started, other_go = anyio.Event(), anyio.Event()
    paid: list[str] = []

    @tool
    def pay(order: str) -> str:
        """Pay an order."""
        paid.append(order)
        raise Halt("halt after paying")

    @tool
    async def slow(x: str) -> str:
        """Harmless, waits for the test."""
        other_started.set()
        await other_go.wait()
        return "ok"

    async def unrelated() -> None:
        async with sl.run(ledger, owner="user:2", thread_id="lg-e-other") as g:
            graph = tool_graph([slow], [call("slow", {"x": "a"}, "k1")])
            await g.ainvoke(graph, {"messages": [("user", "go")]})

    async with anyio.create_task_group() as tg:
        tg.start_soon(unrelated)
        await other_started.wait()
        graph = tool_graph([pay], [call("pay", {"order": "1"}, "c1")])
        with pytest.raises(Halt):
            async with sl.run(ledger, owner="user:1", thread_id="lg-e-halt") as g:
                await g.ainvoke(graph, {"messages": [("user", "pay")]})
        other_go.set()
    assert paid == ["1"]
    assert (await ledger.backend.get_run("lg-e-other")).state is RunState.COMPLETED
    op = await ledger.backend.get_operation("lg-e-halt/tool:c1")
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)


async def test_a_gated_tool_message_keeps_its_fields(ledger: stopline.Ledger) -> None:
    """A call that runs hands the graph the tool's own message: its artifact, its
    ``additional_kwargs`` and ``response_metadata`` (the ledger records the content)."""

    @tool(response_format="content_and_artifact")
    def upload(name: str) -> tuple[str, dict[str, str]]:
        """Upload a file; the artifact is the stored object's handle."""
        return f"uploaded {name}", {"bucket": "b", "etag": "abc123"}

    @tool
    def charge(amount: int) -> ToolMessage:
        """Charge; says itself how it went."""
        return ToolMessage(
            content="charged",
            tool_call_id="c2",
            additional_kwargs={"receipt": "rcpt-9"},
            response_metadata={"psp": "x"},
        )

    graph = tool_graph(
        [upload, charge],
        [call("upload", {"name": "q3.pdf"}, "c1"), call("charge", {"amount": 5}, "c2")],
    )
    async with sl.run(ledger, owner="user:1", thread_id="lg-e-fields") as g:
        state = await g.ainvoke(graph, {"messages": [("user", "go")]})
    messages = {m.tool_call_id: m for m in state["messages"] if isinstance(m, ToolMessage)}
    assert messages["c1"].content == "uploaded q3.pdf"
    assert messages["c1"].artifact == {"bucket": "b", "etag": "abc123"}
    assert messages["c2"].additional_kwargs == {"receipt": "rcpt-9"}
    assert messages["c2"].response_metadata == {"psp": "x"}
    ops = await ledger.backend.operations("lg-e-fields")
    assert [(op.tool, op.result) for op in ops] == [
        ("upload", "uploaded q3.pdf"),
        ("charge", "charged"),
    ]


class Blob(list[str]):
    """A node's result that can be watched (``weakref``) once the run is over."""


async def test_a_def_node_keeps_no_result_once_it_is_recorded(ledger: stopline.Ledger) -> None:
    """A module-level ``sl.node`` on a ``def`` lives as long as the process: it must not
    keep each call's result once the call is delivered."""

    class Done(TypedDict, total=False):
        done: Annotated[list[Any], operator.add]

    made: list[weakref.ref[Blob]] = []

    def charge(state: Done) -> dict[str, Any]:
        blob = Blob(["x" * 1000])
        made.append(weakref.ref(blob))
        return {"done": [blob]}

    builder = StateGraph(Done)
    builder.add_node("charge", sl.node(charge))
    builder.add_edge(START, "charge")
    builder.add_edge("charge", END)
    graph = builder.compile()
    for turn in range(3):
        async with sl.run(ledger, owner="user:1", thread_id=f"lg-e-leak-{turn}") as g:
            await g.ainvoke(graph, {})
    gc.collect()
    assert len(made) == 3
    # the runs' results are the ledger's now (the last may still be on its way there,
    # in the ledger's own outbox): the adapter holds none of them
    assert [ref() for ref in made[:-1]] == [None, None]


def write(note: str) -> str:
    """Write a note."""
    return note


async def awrite(note: str) -> str:
    """Write a note."""
    return note


class OnlyRun(BaseTool):
    name: str = "write"
    description: str = "Write."

    def _run(self, note: str) -> str:
        return note


class OwnArun(OnlyRun):
    async def _arun(self, note: str) -> str:
        return note


@pytest.mark.parametrize(
    ("made", "in_thread"),
    [
        (lambda: tool(write), True),
        (lambda: tool(awrite), False),
        (lambda: StructuredTool.from_function(func=write, coroutine=awrite), False),
        (lambda: Tool.from_function(func=write, name="write", description="Write."), True),
        (lambda: Tool(name="write", description="Write.", func=None, coroutine=awrite), False),
        (lambda: Tool.from_function(write, "write", "Write.", coroutine=awrite), False),
        (OnlyRun, True),
        (OwnArun, False),
    ],
    ids=["def", "async-def", "both", "Tool-def", "Tool-async", "Tool-both", "_run", "_arun"],
)
def test_which_tools_langchain_runs_in_a_thread(made: Any, in_thread: bool) -> None:
    """The gate keeps a thread's call to its end (R4): it must know every kind of
    ``def`` tool LangChain runs in one, and no async tool among them."""
    assert runs_in_thread(made()) is in_thread
