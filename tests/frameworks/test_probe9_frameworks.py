"""Probe 9 of the Agents SDK and LangGraph adapters, with real agents and graphs (ADR 0097).

**A repeat of a call in doubt, in the same entry** (Agents SDK). A function tool's own
``timeout=`` cuts the call: it is recorded ``unknown`` (its effect may have happened).
The model, told "timed out", asked again with the same arguments under a new call id,
and the call was sent a second time: ``Bound.key_for`` matched only calls of earlier
entries. Now the repeat takes the first call's key: the gate reads it back, sends it
again under that key only when it provably did not happen, and otherwise answers the
model that it may have happened (nothing sent). The timed-out call's own text says it
may have taken effect. Calls with other arguments, and a repeat of a call that was
answered, are new operations as before.

**A ``Command`` returned by a gated tool or node** (LangGraph). The ledger keeps JSON
only: a replayed ``ToolNode`` tool told the model "result not kept" and its state
update was lost; a replayed ``sl.node`` raised ``NotReplayable``. Now such a result is
kept as LangGraph's serializer writes it, and a replay returns an equal ``Command``.

Real agents with the SDK's ``ScriptedModel``; real graphs with ``InMemorySaver``; real
SQLite ledgers; events as barriers (a timeout's seconds are the SDK's, never asserted).
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

import anyio
import pytest
from agents import Agent, RunResultStreaming, function_tool, set_tracing_disabled
from agents.testing import ScriptedModel, assistant_message, function_call
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from langgraph.types import Command

import stopline
from stopline import OpStatus, ReadBack, Verdict
from stopline.integrations import langgraph as lg
from stopline.integrations import openai_agents as sl
from tests.frameworks.effects import SyncEffect, statuses, until_unknown

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def no_trace_export() -> None:
    set_tracing_disabled(True)


def told(result: RunResultStreaming) -> dict[str, str]:
    """What the model was handed for each call id."""
    said: dict[str, str] = {}
    for item in result.new_items:
        raw = getattr(item, "raw_item", None)
        if isinstance(raw, dict) and raw.get("type") == "function_call_output":
            said[str(raw["call_id"])] = str(raw["output"])
    return said


class Refunds:
    """An async refund whose first call hangs (the SDK's timeout cuts it); the ground
    truth is ``done`` (an effect made before the hang when ``effect_first``)."""

    def __init__(self, *, effect_first: bool) -> None:
        self.effect_first = effect_first
        self.entered: list[str] = []
        self.done: list[str] = []
        self.never = anyio.Event()  # set at the test's end only

    async def __call__(self, order: str) -> str:
        first = not self.entered
        self.entered.append(order)
        if first and self.effect_first:
            self.done.append(order)  # the effect happened; its answer never comes
        if first:
            await self.never.wait()
        if not (first and self.effect_first):
            self.done.append(order)
        return f"refunded {order}"

    async def read_back(self, ctx: stopline.CallContext) -> ReadBack:
        verdict = Verdict.COMMITTED if self.done else Verdict.NOT_COMMITTED
        return ReadBack(verdict, "refunds", "read back")

    def tool(self) -> Any:
        async def refund(order: str) -> str:
            """Refund an order."""
            return await self(order)

        # the SDK's own seconds: long enough for the body to be entered, never asserted
        return function_tool(refund, timeout=2.0)


async def test_a_repeat_of_a_timed_out_call_in_doubt_is_not_sent_again(
    ledger: stopline.Ledger,
) -> None:
    """The first refund happened and timed out (no read-back: in doubt); the model asks
    for it again: not sent, told why. Another order goes through as before."""
    refunds = Refunds(effect_first=True)
    model = ScriptedModel(
        [
            [function_call("refund", {"order": "1042"}, call_id="c1")],
            [function_call("refund", {"order": "1042"}, call_id="c2")],
            [function_call("refund", {"order": "7"}, call_id="c3")],
            [assistant_message("done")],
        ]
    )
    try:
        async with sl.run(ledger, owner="user:1", run_id="doubt-1") as s:
            result = await s.stream(Agent(name="a", model=model, tools=[refunds.tool()]), "go")
    finally:
        refunds.never.set()
    assert refunds.done == ["1042", "7"]  # once each
    assert refunds.entered.count("1042") == 1  # the repeat never reached the tool
    said = told(result)
    assert "may have taken effect" in said["c1"] and "Do not retry" in said["c1"]
    assert "was not sent" in said["c2"] and "doubt-1/tool:c1" in said["c2"]
    assert said["c3"] == "refunded 7"
    await ledger.wait_settled("doubt-1", timeout=10)
    assert await statuses(ledger, "doubt-1") == {
        "tool:c1": OpStatus.NEEDS_REVIEW,  # no read-back: a person decides
        "tool:c3": OpStatus.COMMITTED,
    }


async def test_a_repeat_of_a_cut_call_proved_not_sent_goes_under_its_key(
    ledger: stopline.Ledger,
) -> None:
    """Cut before its effect: the read-back proves ``not_committed`` and the model's
    repeat is sent again under the first call's key (R5), once."""
    refunds = Refunds(effect_first=False)
    model = ScriptedModel(
        [
            [function_call("refund", {"order": "1042"}, call_id="c1")],
            [function_call("refund", {"order": "1042"}, call_id="c2")],
            [assistant_message("done")],
        ]
    )
    agent = Agent(name="a", model=model, tools=[refunds.tool()])
    try:
        async with sl.run(
            ledger, owner="user:1", run_id="doubt-2", verify={"refund": refunds.read_back}
        ) as s:
            result = await s.stream(agent, "go")
    finally:
        refunds.never.set()
    assert refunds.done == ["1042"]
    assert told(result)["c2"] == "refunded 1042"
    ops = await ledger.backend.operations("doubt-2")
    assert [(op.id, op.status, op.result) for op in ops] == [
        ("doubt-2/tool:c1", OpStatus.COMMITTED, "refunded 1042")
    ]


async def test_a_call_that_raised_is_read_back_before_its_repeat_is_sent(
    ledger: stopline.Ledger,
) -> None:
    """A tool that raised is in doubt as a cut one is (``unknown``): the SDK's "please try
    again" made the model ask again, sent at once under a new key. Now the repeat is
    read back first; proved ``not_committed``, it is sent under the first call's key."""
    done: list[str] = []
    attempts: list[str] = []

    @function_tool
    async def refund(order: str) -> str:
        """Refund an order."""
        attempts.append(order)
        if len(attempts) == 1:
            raise ConnectionError("the payments API hung up")
        done.append(order)
        return f"refunded {order}"

    async def read_back(ctx: stopline.CallContext) -> ReadBack:
        return ReadBack(Verdict.COMMITTED if done else Verdict.NOT_COMMITTED, "refunds", "read")

    model = ScriptedModel(
        [
            [function_call("refund", {"order": "1042"}, call_id="c1")],
            [function_call("refund", {"order": "1042"}, call_id="c2")],
            [assistant_message("done")],
        ]
    )
    async with sl.run(ledger, owner="user:1", run_id="doubt-4", verify={"refund": read_back}) as s:
        result = await s.stream(Agent(name="a", model=model, tools=[refund]), "go")
    assert done == ["1042"] and told(result)["c2"] == "refunded 1042"
    assert await statuses(ledger, "doubt-4") == {"tool:c1": OpStatus.COMMITTED}


async def test_an_answered_call_asked_again_is_a_new_operation(ledger: stopline.Ledger) -> None:
    """The guard (this held before): a call that was answered is no longer open; the
    same call asked for again in the same entry is a new operation."""
    done: list[str] = []

    @function_tool
    async def refund(order: str) -> str:
        """Refund an order."""
        done.append(order)
        return f"refunded {order}"

    model = ScriptedModel(
        [
            [function_call("refund", {"order": "1042"}, call_id="c1")],
            [function_call("refund", {"order": "1042"}, call_id="c2")],
            [assistant_message("done")],
        ]
    )
    async with sl.run(ledger, owner="user:1", run_id="doubt-3") as s:
        await s.stream(Agent(name="a", model=model, tools=[refund]), "go")
    assert done == ["1042", "1042"]
    assert await statuses(ledger, "doubt-3") == {
        "tool:c1": OpStatus.COMMITTED,
        "tool:c2": OpStatus.COMMITTED,
    }


# -- LangGraph: a Command returned by a gated node or tool ------------------------------


class Order(TypedDict, total=False):
    order: str
    done: Annotated[list[str], operator.add]


async def cancel_while_held(
    ledger: stopline.Ledger, graph: Any, graph_input: Any, thread: str, effect: SyncEffect
) -> None:
    """Run ``graph`` until ``effect`` holds its thread, cancel, let it commit late, resume."""
    handles: list[lg.GraphRun] = []

    async def go() -> None:
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            handles.append(g)
            await g.ainvoke(graph, graph_input)

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        await effect.wait_reached()
        (op,) = await ledger.backend.operations(thread)
        await handles[0].cancel(by="user:1")
        await until_unknown(ledger, op.id)
        effect.release.set()  # it commits after the cancel (R4)
    await ledger.wait_settled(thread, timeout=10)
    await ledger.resume(thread, by="user:1")


async def test_a_node_returning_a_command_is_replayed_as_that_command(
    ledger: stopline.Ledger,
) -> None:
    """LangGraph re-runs the cancelled node on resume; the gate replays its recorded
    ``Command`` (it raised ``NotReplayable``): its update and its ``goto`` apply, once."""
    refund = SyncEffect("refund", hold=True)
    notified: list[str] = []

    def issue_refund(state: Order) -> Command[Any]:
        return Command(update={"done": [refund(state["order"])]}, goto="notify")

    def notify(state: Order) -> dict[str, list[str]]:
        notified.append(state["order"])
        return {"done": ["notified"]}

    builder = StateGraph(Order)
    builder.add_node("refund", lg.node(issue_refund), destinations=("notify",))
    builder.add_node("notify", notify)
    builder.add_edge(START, "refund")
    builder.add_edge("notify", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    with refund.released_at_exit():
        await cancel_while_held(ledger, graph, {"order": "1042"}, "lg-cmd-1", refund)
    (op,) = await ledger.backend.operations("lg-cmd-1")
    assert op.status is OpStatus.COMMITTED and op.result_not_kept is None

    async with lg.run(ledger, owner="user:1", thread_id="lg-cmd-1") as g:
        final = await g.ainvoke(graph, None)
    assert refund.effects == ["1042"]  # not repeated
    assert final["done"] == ["refund:1042", "notified"]  # the update and the goto
    assert notified == ["1042"]


class Chat(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    refunded: Annotated[list[str], operator.add]


@pytest.mark.parametrize("way", ["sl.tool", "sl.gate"])
async def test_a_tool_node_tool_returning_a_command_keeps_its_update_on_replay(
    ledger: stopline.Ledger, way: str
) -> None:
    """The tool's ``Command`` (its message and a state update) was replayed as a "result
    not kept" note and the update was lost; now the replay is the same ``Command``."""
    refund = SyncEffect("refund", hold=True)
    call = {"name": "issue_refund", "args": {"order": "9"}, "id": "call_a", "type": "tool_call"}

    def issue_refund(order: str) -> Command[Any]:
        """Refund an order."""
        message = ToolMessage(refund(order), tool_call_id="call_a")
        return Command(update={"messages": [message], "refunded": [order]})

    def model(state: Chat) -> dict[str, list[AnyMessage]]:  # the scripted "model"
        return {"messages": [AIMessage(content="", tool_calls=[call])]}

    builder = StateGraph(Chat)
    builder.add_node("model", model)
    tools = (
        ToolNode([lg.tool(issue_refund)])
        if way == "sl.tool"
        else ToolNode([issue_refund], awrap_tool_call=lg.gate())
    )
    builder.add_node("tools", tools)
    builder.add_edge(START, "model")
    builder.add_edge("model", "tools")
    builder.add_edge("tools", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    with refund.released_at_exit():
        await cancel_while_held(ledger, graph, {"messages": []}, f"lg-cmd-{way}", refund)

    async with lg.run(ledger, owner="user:1", thread_id=f"lg-cmd-{way}") as g:
        final = await g.ainvoke(graph, None)
    assert refund.effects == ["9"]  # not repeated
    assert final["refunded"] == ["9"]  # the command's update, replayed
    answer = final["messages"][-1]
    assert isinstance(answer, ToolMessage) and answer.content == "refund:9"


async def test_a_node_update_holding_messages_is_replayed_equal(ledger: stopline.Ledger) -> None:
    """The same for a plain update JSON cannot write (a message object)."""
    refund = SyncEffect("refund", hold=True)

    def issue_refund(state: Chat) -> dict[str, Any]:
        done = refund("9")
        return {"messages": [AIMessage(content=done, id="m-1")], "refunded": ["9"]}

    builder = StateGraph(Chat)
    builder.add_node("refund", lg.node(issue_refund))
    builder.add_edge(START, "refund")
    builder.add_edge("refund", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    with refund.released_at_exit():
        await cancel_while_held(ledger, graph, {"messages": []}, "lg-cmd-3", refund)

    async with lg.run(ledger, owner="user:1", thread_id="lg-cmd-3") as g:
        final = await g.ainvoke(graph, None)
    assert refund.effects == ["9"]
    assert final["refunded"] == ["9"]
    assert final["messages"] == [AIMessage(content="refund:9", id="m-1")]


# -- one rule for every adapter: a LangGraph tool that raised, asked for again -----------
class Turns(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def turns_graph(tool: Any, turns: list[dict[str, Any]]) -> Any:
    """agent (one scripted call per turn) <-> a gated ``ToolNode`` whose errors are
    messages for the model (``handle_tool_errors=True``), until the turns run out."""
    left = list(turns)

    async def agent(state: Turns) -> dict[str, Any]:
        calls = [left.pop(0)] if left else []
        return {"messages": [AIMessage("" if calls else "done", tool_calls=calls)]}

    def route(state: Turns) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

    builder = StateGraph(Turns)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode([tool], awrap_tool_call=lg.gate(), handle_tool_errors=True))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", route, ["tools", END])
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=InMemorySaver())


async def test_a_langgraph_repeat_of_a_tool_call_that_raised_is_not_sent_again(
    ledger: stopline.Ledger,
) -> None:
    """``ToolNode`` made the tool's error a message (the model reads "try again"); the
    gate recorded the call ``unknown``, its effect made before it raised. The model's
    repeat with the same arguments takes the first call's key (``gated_call``, one
    place for every adapter): in doubt, nothing is sent and the model is told why.
    Another order goes through as before."""
    paid: list[str] = []

    async def pay(order: str) -> str:
        """Pay an order."""
        paid.append(order)
        if order == "1":
            raise RuntimeError("the provider's answer was lost after the payment")
        return f"paid {order}"

    tool = StructuredTool.from_function(coroutine=pay, name="pay", description="Pay an order.")
    graph = turns_graph(
        tool,
        [
            {"name": "pay", "args": {"order": "1"}, "id": "c1", "type": "tool_call"},
            {"name": "pay", "args": {"order": "1"}, "id": "c2", "type": "tool_call"},
            {"name": "pay", "args": {"order": "2"}, "id": "c3", "type": "tool_call"},
        ],
    )
    async with lg.run(ledger, owner="user:1", thread_id="lg-repeat") as g:
        state = await g.ainvoke(graph, {"messages": [("user", "pay")]})
    assert paid == ["1", "2"]  # the repeat never reached the tool
    said = {m.tool_call_id: m for m in state["messages"] if isinstance(m, ToolMessage)}
    assert said["c1"].status == "error"
    assert "was not sent" in str(said["c2"].content)
    assert "lg-repeat/tool:c1" in str(said["c2"].content)
    assert said["c3"].content == "paid 2"
    await ledger.wait_settled("lg-repeat", timeout=10)
    got = await statuses(ledger, "lg-repeat")
    assert set(got) == {"tool:c1", "tool:c3"}  # no operation of its own for the repeat
    assert got["tool:c1"] in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
    assert got["tool:c3"] is OpStatus.COMMITTED
