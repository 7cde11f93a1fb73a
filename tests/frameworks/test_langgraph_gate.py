"""LangGraph: every tool of a ``ToolNode`` gated through ``awrap_tool_call``;
``interrupt()`` and breakpoints as pauses with stopline approvals; resume on the same
thread that never repeats.

The tools are plain LangChain tools, not wrapped one by one. The ground truth is a
file each side-effecting call appends to (``FileEffect``). The model is
``langchain_core``'s own ``GenericFakeChatModel``; checkpoints are LangGraph's
``InMemorySaver``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import anyio
import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.tools import BaseTool, Tool
from langchain_core.tools import tool as lc_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from langgraph.types import Command, interrupt

import stopline
from stopline import Headline, OpStatus, RunState
from stopline.integrations import langgraph as sl
from tests.frameworks.effects import FileEffect, until_unknown

pytestmark = pytest.mark.timeout(30)


class Chat(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def replies(args: dict[str, Any] | None = None) -> Iterator[AIMessage]:
    """The fake model: asks for ``write_note`` once (with ``args``), then answers."""
    args = {"note": "refund 9"} if args is None else args
    call = {"name": "write_note", "args": args, "id": "c1", "type": "tool_call"}
    yield AIMessage(content="", tool_calls=[call])
    while True:
        yield AIMessage(content="done")


class Graph:
    """model -> tools (gated by the hook) -> model, until the model stops asking."""

    def __init__(
        self,
        tool: Any,
        verify: Any = None,
        args: dict[str, Any] | None = None,
        **compile_options: Any,
    ) -> None:
        self.model = GenericFakeChatModel(messages=replies(args))
        self.asking: anyio.Event | None = None  # the model's first turn waits for it
        self.thinking: anyio.Event | None = None  # ... its second turn, for this one
        self.asked = anyio.Event()
        self.answering = anyio.Event()

        async def agent(state: Chat) -> dict[str, list[AnyMessage]]:
            if any(isinstance(m, ToolMessage) for m in state["messages"]):
                self.answering.set()
                if self.thinking is not None:
                    await self.thinking.wait()
            elif self.asking is not None:
                self.asked.set()
                await self.asking.wait()
            return {"messages": [await self.model.ainvoke(state["messages"])]}

        def route(state: Chat) -> str:
            last = state["messages"][-1]
            return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

        builder = StateGraph(Chat)
        builder.add_node("agent", agent)
        hook = sl.gate(verify={"write_note": verify} if verify else None)
        builder.add_node("tools", ToolNode([tool], awrap_tool_call=hook))
        builder.add_edge(START, "agent")
        builder.add_conditional_edges("agent", route, ["tools", END])
        builder.add_edge("tools", "agent")
        self.graph = builder.compile(checkpointer=InMemorySaver(), **compile_options)


def write_tool(effect: FileEffect, *, sync: bool) -> Any:
    if sync:

        @lc_tool
        def write_note(note: str) -> str:
            """Write a note (a plain def: LangGraph runs it in a thread)."""
            return effect.write(note)

        return write_note

    @lc_tool
    async def write_note_async(note: str) -> str:
        """Write a note."""
        return await effect.awrite(note)

    write_note_async.name = "write_note"
    return write_note_async


class Workflow:
    """A graph run in a stopline run, started in a task group."""

    def __init__(self) -> None:
        self.handle: sl.GraphRun | None = None
        self.ready = anyio.Event()
        self.output: Any = None

    @property
    def g(self) -> sl.GraphRun:
        assert self.handle is not None
        return self.handle

    async def __call__(
        self, ledger: stopline.Ledger, graph: Any, graph_input: Any, thread: str
    ) -> None:
        async with sl.run(ledger, owner="user:1", thread_id=thread, approver="manager:1") as g:
            self.handle = g
            self.ready.set()
            self.output = await g.ainvoke(graph, graph_input)


async def resume(ledger: stopline.Ledger, graph: Any, graph_input: Any, thread: str) -> Any:
    await ledger.resume(thread, by="user:1")
    workflow = Workflow()
    await workflow(ledger, graph, graph_input, thread)
    return workflow.output


def start() -> dict[str, Any]:
    return {"messages": [("user", "refund order 9")]}


async def test_s01_langgraph_tool_node_cancel_before_the_call_then_resume(
    unwatched: stopline.Ledger, ledger_url: str, tmp_path: Path
) -> None:
    """Every tool of the node is gated by the hook: a cancel committed elsewhere refuses
    the call; resumed on the same thread, the call runs once."""
    ledger = unwatched  # a worker that does not watch: its gate is where it learns
    effect = FileEffect(tmp_path / "notes.txt")
    graph = Graph(write_tool(effect, sync=False))
    graph.asking = anyio.Event()
    workflow = Workflow()
    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow, ledger, graph.graph, start(), "lg-g-s01")
        await graph.asked.wait()
        async with stopline.open(ledger_url) as elsewhere:  # the gate is where it learns
            await elsewhere.cancel("lg-g-s01", by="user:1")
        graph.asking.set()
    receipt = await ledger.wait_settled("lg-g-s01", timeout=10)
    assert effect.lines() == []
    assert [line.status for line in receipt.lines] == [OpStatus.PREVENTED]

    state = await resume(ledger, graph.graph, None, "lg-g-s01")
    assert state["messages"][-1].content == "done"
    assert effect.lines() == ["refund 9"]


def async_basetool(effect: FileEffect) -> BaseTool:
    """A ``BaseTool`` subclass with its own ``_arun``: async, so a cancel interrupts it."""

    class WriteNote(BaseTool):
        name: str = "write_note"
        description: str = "Write a note."

        def _run(self, note: str) -> str:
            raise NotImplementedError("async only")

        async def _arun(self, note: str) -> str:
            return await effect.awrite(note)

    return WriteNote()


@pytest.mark.parametrize("kind", ["tool", "basetool"])
async def test_s02_langgraph_cancel_during_an_async_tool_then_resume(
    ledger: stopline.Ledger, tmp_path: Path, kind: str
) -> None:
    """Cancelled before the async tool writes: unknown, read back (``verify``), not
    committed; the resumed thread re-runs the call under its id and writes once."""
    thread = f"lg-g-s02-{kind}"
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        tool = write_tool(effect, sync=False) if kind == "tool" else async_basetool(effect)
        graph = Graph(tool, verify=effect.read_back())
        workflow = Workflow()
        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow, ledger, graph.graph, start(), thread)
            await effect.async_reached.wait()
            await workflow.g.cancel(by="user:1")
        receipt = await ledger.wait_settled(thread, timeout=10)
        (op,) = await ledger.backend.operations(thread)
        assert op.id == f"{thread}/tool:c1" and op.status is OpStatus.NOT_COMMITTED
        assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
        assert effect.lines() == []

        effect.hold = False
        await resume(ledger, graph.graph, None, thread)
    assert effect.lines() == ["refund 9"]


async def test_s09_langgraph_cancel_during_a_def_tool_then_resume(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The plain-def tool writes after the cancel: kept as committed; the resumed thread
    re-runs the tool node and gets the recorded result: one write."""
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        graph = Graph(write_tool(effect, sync=True))
        workflow = Workflow()
        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow, ledger, graph.graph, start(), "lg-g-s09")
            await effect.wait_reached()
            await workflow.g.cancel(by="user:1")
            await until_unknown(ledger, "lg-g-s09/tool:c1")
            effect.release.set()
        receipt = await ledger.wait_settled("lg-g-s09", timeout=10)
    assert effect.lines() == ["refund 9"]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS

    state = await resume(ledger, graph.graph, None, "lg-g-s09")
    assert effect.lines() == ["refund 9"]
    assert [m.content for m in state["messages"] if isinstance(m, ToolMessage)] == [
        "wrote refund 9"
    ]


def other_def_tool(effect: FileEffect, kind: str) -> tuple[BaseTool, dict[str, Any]]:
    """A plain-def ``write_note`` that is not ``@tool``'s ``StructuredTool``, and the
    arguments the model gives it. LangChain runs each in an executor thread too."""
    if kind == "basetool":  # LangChain's "subclass BaseTool" pattern: only ``_run``

        class WriteNote(BaseTool):
            name: str = "write_note"
            description: str = "Write a note."

            def _run(self, note: str) -> str:
                return effect.write(note)

        return WriteNote(), {"note": "refund 9"}
    function_tool = Tool.from_function(
        func=effect.write, name="write_note", description="Write a note."
    )
    return function_tool, {"__arg1": "refund 9"}  # a ``Tool`` takes one string


@pytest.mark.parametrize("verified", [False, True], ids=["no-verifier", "read-back"])
@pytest.mark.parametrize("kind", ["basetool", "function-tool"])
async def test_s09_langgraph_cancel_during_any_def_tool_keeps_its_late_result(
    ledger: stopline.Ledger, tmp_path: Path, kind: str, verified: bool
) -> None:
    """A ``BaseTool`` with only ``_run``, or ``Tool.from_function(func=<def>)``, runs in
    a thread the cancel cannot stop, as an ``@tool`` def does. They were taken for
    async tools: the cancel ended the wait and the thread's result was never attached.
    A read-back made before the thread wrote said "did not happen" and the resume
    wrote again; one made after it found the write but no result to replay; with
    none, the call waited for review. Now the call is kept to its end: committed with
    its result, replayed on resume, written once."""
    thread = f"lg-g-s09-{kind}-{verified}"
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        tool, args = other_def_tool(effect, kind)
        verify = effect.read_back() if verified else None
        graph = Graph(tool, verify=verify, args=args)
        workflow = Workflow()
        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow, ledger, graph.graph, start(), thread)
            await effect.wait_reached()
            await workflow.g.cancel(by="user:1")
            await until_unknown(ledger, f"{thread}/tool:c1")
            effect.release.set()
        receipt = await ledger.wait_settled(thread, timeout=10)
        assert effect.lines() == ["refund 9"]
        assert "did not happen" not in receipt.text()
        assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
        assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
        (op,) = await ledger.backend.operations(thread)
        assert op.has_result and op.result == "wrote refund 9"  # the thread's late answer

    state = await resume(ledger, graph.graph, None, thread)
    assert effect.lines() == ["refund 9"]
    assert [m.content for m in state["messages"] if isinstance(m, ToolMessage)] == [
        "wrote refund 9"
    ]
    assert (await ledger.receipt(thread)).headline is Headline.COMPLETED


async def test_s03_langgraph_cancel_after_the_tool_then_resume(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    effect = FileEffect(tmp_path / "notes.txt")
    graph = Graph(write_tool(effect, sync=False))
    graph.thinking = anyio.Event()
    workflow = Workflow()
    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow, ledger, graph.graph, start(), "lg-g-s03")
        await graph.answering.wait()
        await workflow.g.cancel(by="user:1")
    receipt = await ledger.wait_settled("lg-g-s03", timeout=10)
    assert effect.lines() == ["refund 9"]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS

    graph.thinking = None
    state = await resume(ledger, graph.graph, None, "lg-g-s03")
    assert state["messages"][-1].content == "done"
    assert effect.lines() == ["refund 9"]


async def test_langgraph_raising_tool_is_not_completed(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The tool raises (``ToolNode`` re-raises what is not an argument error): the
    operation is recorded as it leaves the hook: unknown, never "completed"."""

    @lc_tool
    async def write_note(note: str) -> str:
        """Write a note."""
        raise TimeoutError("the notes service did not answer")

    graph = Graph(write_note)
    with pytest.raises(TimeoutError):
        await Workflow()(ledger, graph.graph, start(), "lg-g-raise")
    (op,) = await ledger.backend.operations("lg-g-raise")
    kinds = [e.kind for e in await ledger.backend.events("lg-g-raise") if e.op_id == op.id]
    assert "lost" in kinds and "committed" not in kinds
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("args", [{"memo": "x"}, {"note": ["a"]}], ids=["missing", "wrong-type"])
async def test_langgraph_arguments_the_tool_refuses_pass_no_gate(
    ledger: stopline.Ledger, tmp_path: Path, sync: bool, args: dict[str, Any]
) -> None:
    """The model's arguments do not fit the tool's schema: ``ToolNode`` refuses them
    before the function runs and tells the model. They were gated, recorded
    ``unknown`` and the receipt said "verifying" for a call that did nothing. No
    operation is recorded now, and the model gets ``ToolNode``'s own message."""
    effect = FileEffect(tmp_path / "notes.txt")
    graph = Graph(write_tool(effect, sync=sync), args=args)
    workflow = Workflow()
    await workflow(ledger, graph.graph, start(), "lg-g-args")
    assert await ledger.backend.operations("lg-g-args") == []
    assert effect.lines() == []
    told = [m for m in workflow.output["messages"] if isinstance(m, ToolMessage)]
    assert len(told) == 1 and told[0].status == "error"
    assert str(told[0].content).startswith("Error invoking tool 'write_note' with kwargs")
    receipt = await ledger.wait_settled("lg-g-args", timeout=10)
    assert receipt.headline is Headline.COMPLETED


async def test_s05_langgraph_interrupt_in_a_gated_tool_is_a_pause(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """``interrupt()`` asks a person before the write: the attempt is not committed (not
    a failure), the run paused with a stopline approval; approved and resumed with
    ``Command(resume=...)``, the call writes once."""
    effect = FileEffect(tmp_path / "notes.txt")

    @lc_tool
    async def write_note(note: str) -> str:
        """Write a note, once a person says so."""
        if not interrupt({"approve": note}):
            return "not approved"
        return await effect.awrite(note)

    graph = Graph(write_note)
    first = Workflow()
    await first(ledger, graph.graph, start(), "lg-g-int")
    receipt = await ledger.receipt("lg-g-int")
    assert receipt.run_state is RunState.PAUSED and receipt.headline is Headline.PAUSED
    (op,) = await ledger.backend.operations("lg-g-int")
    assert op.status is OpStatus.NOT_COMMITTED  # paused, not "may have happened"
    (approval,) = await ledger.backend.approvals("lg-g-int")
    assert approval.scope == "lg-g-int/tool:c1" and approval.approver == "manager:1"
    with pytest.raises(stopline.RunPaused):
        async with sl.run(ledger, owner="user:1", thread_id="lg-g-int"):
            pass

    await ledger.approve(approval.id, by="manager:1")
    state = await resume(ledger, graph.graph, Command(resume=True), "lg-g-int")
    assert state["messages"][-1].content == "done"
    assert effect.lines() == ["refund 9"]
    final = await ledger.receipt("lg-g-int")
    assert final.headline is Headline.COMPLETED
    assert [line.status for line in final.lines] == [OpStatus.COMMITTED]


async def test_s05_langgraph_breakpoint_before_tools_then_approved_resume(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """A breakpoint before the tool node: the run is paused with one approval per pending
    tool call; without the approval the call is refused; approved, the same thread runs
    it (it used to run nothing)."""
    effect = FileEffect(tmp_path / "notes.txt")
    graph = Graph(write_tool(effect, sync=False), interrupt_before=["tools"])
    await Workflow()(ledger, graph.graph, start(), "lg-g-bp")
    receipt = await ledger.receipt("lg-g-bp")
    assert receipt.run_state is RunState.PAUSED and receipt.headline is Headline.PAUSED
    (approval,) = await ledger.backend.approvals("lg-g-bp")
    assert approval.scope == "lg-g-bp/tool:c1"

    await ledger.approve(approval.id, by="manager:1")
    state = await resume(ledger, graph.graph, None, "lg-g-bp")
    assert state["messages"][-1].content == "done"
    assert effect.lines() == ["refund 9"]
    assert (await ledger.receipt("lg-g-bp")).headline is Headline.COMPLETED
    async with sl.run(ledger, owner="user:1", thread_id="lg-g-bp") as g:
        assert g.id == "lg-g-bp@turn:2"  # the thread goes on in its next run (ADR 0107)
    assert effect.lines() == ["refund 9"]


async def test_langgraph_cancelling_the_task_is_a_stopline_cancel(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        graph = Graph(write_tool(effect, sync=False), verify=effect.read_back())
        async with anyio.create_task_group() as tg:
            tg.start_soon(Workflow(), ledger, graph.graph, start(), "lg-g-task")
            await effect.async_reached.wait()
            tg.cancel_scope.cancel()
    receipt = await ledger.wait_settled("lg-g-task", timeout=10)
    assert receipt.run_state is RunState.CANCELLED
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED]
    assert effect.lines() == []


async def test_langgraph_a_read_back_result_is_replayed_as_message_content(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """A call cut after its write is read back committed with the provider's record (a
    dict); the resumed thread replays that result as the tool's message content, made
    as ``ToolNode`` makes it (JSON), not handed to LangGraph as if it were a state update."""
    effect = FileEffect(tmp_path / "notes.txt")
    wrote, answer = anyio.Event(), anyio.Event()

    @lc_tool
    async def write_note(note: str) -> str:
        """Write a note, then wait for the provider's answer."""
        effect.write(note)
        wrote.set()
        await answer.wait()  # never set: the cancel cuts the wait
        return "answered"

    async def read_back(ctx: stopline.CallContext) -> stopline.ReadBack:
        return stopline.ReadBack(
            stopline.Verdict.COMMITTED, "file:notes", result={"lines": effect.lines()}
        )

    graph = Graph(write_note, verify=read_back)
    workflow = Workflow()
    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow, ledger, graph.graph, start(), "lg-g-rb")
        await wrote.wait()
        await workflow.g.cancel(by="user:1")
    receipt = await ledger.wait_settled("lg-g-rb", timeout=10)
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]

    state = await resume(ledger, graph.graph, None, "lg-g-rb")
    assert effect.lines() == ["refund 9"]
    assert [m.content for m in state["messages"] if isinstance(m, ToolMessage)] == [
        '{"lines": ["refund 9"]}'
    ]
