"""LangGraph through stopline: the peers probe, resume, S1, S3 and S9.

No model: a scripted node plays the model (it emits the tool calls with fixed
ids), LangGraph's own ``InMemorySaver`` keeps the checkpoints.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

import anyio
import pytest
from langchain_core.messages import AIMessage, AnyMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode

import stopline
from stopline import Cancellable, Cause, Headline, OpStatus
from stopline.integrations import langgraph as sl
from stopline.testing import FakeProvider
from tests.frameworks.effects import AsyncEffect, SyncEffect, until_unknown

pytestmark = pytest.mark.timeout(30)


class Order(TypedDict, total=False):
    order: str
    done: Annotated[list[str], operator.add]


class Chat(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def order_graph(*nodes: tuple[str, Any]) -> Any:
    """START -> each node in turn -> END, checkpointed in memory."""
    builder = StateGraph(Order)
    previous = START
    for name, fn in nodes:
        builder.add_node(name, fn)
        builder.add_edge(previous, name)
        previous = name
    builder.add_edge(previous, END)
    return builder.compile(checkpointer=InMemorySaver())


class Workflow:
    """A graph run started in a task group; ``entries`` counts its invocations."""

    def __init__(self) -> None:
        self.handle: sl.GraphRun | None = None
        self.ready = anyio.Event()
        self.entries = 0

    @property
    def g(self) -> sl.GraphRun:
        assert self.handle is not None
        return self.handle

    async def __call__(
        self, ledger: stopline.Ledger, graph: Any, graph_input: Any, thread: str
    ) -> None:
        async with sl.run(ledger, owner="user:1", thread_id=thread) as g:
            self.handle = g
            self.entries += 1
            self.ready.set()
            await g.ainvoke(graph, graph_input)


async def test_probe_langgraph_sync_node_commits_after_cancel_and_resume_repeats_nothing(
    ledger: stopline.Ledger,
) -> None:
    """peers.md: a sync node committed after cancel, and resume ran it again."""
    reserve = AsyncEffect("reserve")
    refund = SyncEffect("refund", hold=True)

    async def reserve_stock(state: Order) -> dict[str, list[str]]:
        return {"done": [await reserve(state["order"])]}

    def issue_refund(state: Order) -> dict[str, list[str]]:
        return {"done": [refund(state["order"])]}

    graph = order_graph(("reserve", sl.node(reserve_stock)), ("refund", sl.node(issue_refund)))
    workflow = Workflow()
    with refund.released_at_exit():
        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow, ledger, graph, {"order": "1042"}, "t-probe")
            await refund.wait_reached()
            ops = await ledger.backend.operations("t-probe")
            refund_op = next(op.id for op in ops if op.tool == "issue_refund")
            at_cancel = await workflow.g.cancel(by="user:1", reason="stop")
            assert at_cancel.run_state is stopline.RunState.CANCELLING
            await until_unknown(ledger, refund_op)
            refund.release.set()  # the sync effect finishes after the cancel
    receipt = await ledger.wait_settled("t-probe", timeout=10)
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.COMMITTED]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    late = await ledger.backend.operations("t-probe")
    assert late[1].cause is Cause.USER_CANCEL  # it was unknown first: the wait was aborted
    assert any(e.data.get("late") for e in await ledger.backend.events("t-probe"))
    assert refund.effects == ["1042"]

    # resume: LangGraph re-runs the cancelled task; stopline replays its recorded result
    await ledger.resume("t-probe", by="user:1")
    again = Workflow()
    await again(ledger, graph, None, "t-probe")
    assert reserve.effects == ["1042"] and refund.effects == ["1042"]  # neither repeated
    state = await graph.aget_state(again.g.config)
    assert state.values["done"] == ["reserve:1042", "refund:1042"]
    final = await ledger.receipt("t-probe")
    assert final.headline is Headline.COMPLETED
    assert len(final.lines) == 2


async def test_s01_langgraph_cancel_before_the_tool_call(
    unwatched: stopline.Ledger, ledger_url: str
) -> None:
    """Cancelled from another process while the agent thinks: the gate refuses the node."""
    ledger = unwatched  # a worker that does not watch: its gate is where it learns
    send = FakeProvider("send")
    thinking = anyio.Event()

    async def think(state: Order) -> dict[str, list[str]]:
        await thinking.wait()
        return {"done": ["thought"]}

    graph = order_graph(("think", think), ("send", sl.node(send.tool)))
    workflow = Workflow()
    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow, ledger, graph, {"order": "1"}, "t-s01")
        await workflow.ready.wait()
        async with stopline.open(ledger_url) as elsewhere:  # the gate is where it learns
            first = await elsewhere.cancel("t-s01", by="user:1")
        assert first.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
        thinking.set()
    receipt = await ledger.wait_settled("t-s01", timeout=10)
    assert send.requests == []
    assert [line.status for line in receipt.lines] == [OpStatus.PREVENTED]
    assert receipt.message == "Canceled before external action."


async def test_s01_langgraph_cancel_in_process_stops_the_graph(ledger: stopline.Ledger) -> None:
    """``g.cancel`` while the model thinks: the graph stops, nothing is sent."""
    send = FakeProvider("send")
    thinking = anyio.Event()

    async def think(state: Order) -> dict[str, list[str]]:
        thinking.set()
        await anyio.sleep_forever()  # the model never answers: the cancel stops it
        return {}

    graph = order_graph(("think", think), ("send", sl.node(send.tool)))
    workflow = Workflow()
    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow, ledger, graph, {"order": "1"}, "t-s01b")
        await thinking.wait()
        await workflow.g.cancel(by="user:1")
    receipt = await ledger.wait_settled("t-s01b", timeout=10)
    assert send.requests == [] and receipt.lines == ()
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION


async def test_s03_langgraph_cancel_after_commit_before_response(ledger: stopline.Ledger) -> None:
    """The provider committed; the graph is cancelled before the answer: unknown, verified."""
    notify = FakeProvider("notify", cancellable=Cancellable.NEVER)
    held = notify.hold("committed")
    graph = order_graph(("notify", sl.node(notify.tool)))
    workflow = Workflow()
    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow, ledger, graph, {"order": "7"}, "t-s03")
        await held.reached.wait()
        await workflow.g.cancel(by="user:1")
    receipt = await ledger.wait_settled("t-s03", timeout=10)
    (op,) = await ledger.backend.operations("t-s03")
    kinds = [e.kind for e in await ledger.backend.events("t-s03") if e.op_id == op.id]
    assert kinds.index("lost") < kinds.index("verified_committed")  # unknown, then proven
    assert op.status is OpStatus.COMMITTED and op.cause is Cause.USER_CANCEL
    assert notify.effects == [held.key]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_s09_langgraph_late_success_of_a_tool_after_cancel(ledger: stopline.Ledger) -> None:
    """A sync tool in a ``ToolNode`` finishes after the cancel: kept, not re-run."""
    refund = SyncEffect("refund", hold=True)
    reserve = AsyncEffect("reserve")

    def issue_refund(order: str) -> str:
        """Refund an order."""
        return refund(order)

    async def reserve_stock(order: str) -> str:
        """Reserve stock for an order."""
        return await reserve(order)

    calls = [
        {"name": "reserve_stock", "args": {"order": "9"}, "id": "call_a", "type": "tool_call"},
        {"name": "issue_refund", "args": {"order": "9"}, "id": "call_b", "type": "tool_call"},
    ]

    def model(state: Chat) -> dict[str, list[AnyMessage]]:  # the scripted "model"
        return {"messages": [AIMessage(content="", tool_calls=calls)]}

    builder = StateGraph(Chat)
    builder.add_node("model", model)
    builder.add_node("tools", ToolNode([sl.tool(reserve_stock), sl.tool(issue_refund)]))
    builder.add_edge(START, "model")
    builder.add_edge("model", "tools")
    builder.add_edge("tools", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    workflow = Workflow()
    with refund.released_at_exit():
        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow, ledger, graph, {"messages": []}, "t-s09")
            await refund.wait_reached()
            await workflow.g.cancel(by="user:1")
            await until_unknown(ledger, "t-s09/tool:call_b")
            refund.release.set()
    receipt = await ledger.wait_settled("t-s09", timeout=10)
    ops = {op.id: op for op in await ledger.backend.operations("t-s09")}
    assert set(ops) == {"t-s09/tool:call_a", "t-s09/tool:call_b"}  # keyed by tool_call_id
    late = ops["t-s09/tool:call_b"]
    assert late.status is OpStatus.COMMITTED and late.result == "refund:9"
    assert any(e.data.get("late") for e in await ledger.backend.events("t-s09"))
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert workflow.entries == 1  # the workflow was not restarted

    await ledger.resume("t-s09", by="user:1")
    await Workflow()(ledger, graph, None, "t-s09")
    assert refund.effects == ["9"] and reserve.effects == ["9"]
    state = await graph.aget_state({"configurable": {"thread_id": "t-s09"}})
    answers = [m.content for m in state.values["messages"][1:]]
    assert answers == ["reserve:9", "refund:9"]  # the recorded results, replayed
