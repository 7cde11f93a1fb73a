"""Probe 10 of the LangGraph adapter, from a user's side (ADR 0101).

**A kept result that cannot be read back.** A ``Command`` (or an update holding
messages) is kept as LangGraph's serializer writes it (ADR 0097). A record of it that
this process cannot decode (damaged, or of a kind another serializer writes) raised a
raw decode error out of the graph on replay; now a node's replay raises
``NotReplayable`` naming the operation, a tool's answers the model that its result
was not kept, and nothing is sent or recorded again.

**A result of the kept record's own shape.** A tool whose real result is a dict with
the marker key and the kept record's keys was decoded as a kept record, live and on
replay. Now such a result is itself kept, and comes back as itself.

**``interrupt()`` in an ``sl.tool`` function** was recorded ``unknown`` (an effect that
may have happened, then a reviewer's question) and the resumed graph stopped on
``OperationInDoubt``; it is a pause now, as under ``sl.gate``.

**A ``ParentCommand`` out of a gated tool** (a graph the tool ran handed a command to
the graph running the tool) was recorded as a pause that did not happen (``sl.gate``)
or as ``unknown`` (``sl.tool``); the tool ran to its end, so a resume ran it again.
Now it is ``committed``, with its command, and a replay routes the graph the same way.

Parallel tool calls of one ``ToolNode`` with one failing or pausing, and a gated node in
a subgraph handing a command to its parent, are recorded truthfully and never repeated.

Real graphs with ``InMemorySaver``, real ``ToolNode``s, LangChain tools; real SQLite
ledgers; barriers (events), never sleeps.
"""

from __future__ import annotations

import json
import operator
import sqlite3
from typing import Annotated, Any, TypedDict

import anyio
import pytest
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.tools import tool as lc_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from langgraph.types import Command, interrupt

import stopline
from stopline import Headline, OpStatus, RunState
from stopline.integrations import langgraph as lg
from tests.frameworks.effects import SyncEffect
from tests.frameworks.test_probe9_frameworks import cancel_while_held

pytestmark = pytest.mark.timeout(30)

MARKER = "io.stopline/langgraph"


class Chat(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    routed: Annotated[list[str], operator.add]


class Order(TypedDict, total=False):
    order: str
    done: Annotated[list[str], operator.add]


def call(name: str, call_id: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "args": args, "id": call_id, "type": "tool_call"}


def one_turn(calls: list[dict[str, Any]], tools: ToolNode) -> Any:
    return scripted([calls], tools)


def scripted(turns: list[list[dict[str, Any]]], tools: ToolNode) -> Any:
    """model (asks for one turn's calls at a time, then answers) -> tools -> model; a
    command of a tool may route to ``elsewhere`` too."""
    left = list(turns)

    def model(state: Chat) -> dict[str, Any]:
        calls = left.pop(0) if left else []
        return {"messages": [AIMessage("" if calls else "done", tool_calls=calls)]}

    def route(state: Chat) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

    builder = StateGraph(Chat)
    builder.add_node("model", model)
    builder.add_node("tools", tools, destinations=("elsewhere",))
    builder.add_node("elsewhere", lambda state: {"routed": ["elsewhere"]})
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", route, ["tools", END])
    builder.add_edge("tools", "model")
    builder.add_edge("elsewhere", END)
    return builder.compile(checkpointer=InMemorySaver())


def gated(way: str, *tools: Any) -> ToolNode:
    """A ``ToolNode`` of ``tools``: gated by the hook, or each made an ``sl.tool``."""
    if way == "gate":
        return ToolNode([lc_tool(t) for t in tools], awrap_tool_call=lg.gate())
    return ToolNode([lg.tool(t) for t in tools])


async def ops(ledger: stopline.Ledger, run_id: str) -> dict[str, tuple[OpStatus, Any]]:
    return {
        op.id.removeprefix(f"{run_id}/"): (op.status, op.result)
        for op in await ledger.backend.operations(run_id)
    }


async def until_committed(ledger: stopline.Ledger, op_id: str) -> None:
    while (await ledger.backend.get_operation(op_id)).status is not OpStatus.COMMITTED:
        await ledger.wait_for_change(op_id.partition("/")[0])


async def approve_and_resume(ledger: stopline.Ledger, thread: str) -> None:
    for approval in await ledger.backend.approvals(thread):
        if approval.status is stopline.ApprovalStatus.PENDING:
            await ledger.approve(approval.id, by="user:1")
    await ledger.resume(thread, by="user:1")


# -- a kept record that cannot be read back ---------------------------------------------
def damage(ledger_url: str, op_id: str, how: str) -> None:
    """What another version of the serializer, or a damaged store, left in the record."""
    db = sqlite3.connect(ledger_url.removeprefix("sqlite:///"))
    try:
        (text,) = db.execute("SELECT result FROM operations WHERE id = ?", (op_id,)).fetchone()
        record = json.loads(text)
        assert set(record) == {MARKER, "data", "shows"}  # the record the adapter kept
        if how == "not base64":
            record["data"] = "not base64!"
        elif how == "another kind":
            record[MARKER] = "pickle"  # a serializer with ``pickle_fallback`` writes it
        else:
            record["data"] = record["data"][:12]  # truncated bytes
        db.execute("UPDATE operations SET result = ? WHERE id = ?", (json.dumps(record), op_id))
        db.commit()
    finally:
        db.close()


DAMAGES = ["not base64", "another kind", "truncated"]


@pytest.mark.parametrize("how", DAMAGES)
async def test_a_node_whose_kept_result_cannot_be_read_back_is_not_replayable(
    ledger: stopline.Ledger, ledger_url: str, how: str
) -> None:
    """The replayed node raised the decoder's own error; now ``NotReplayable`` naming
    the operation, the effect not repeated and nothing recorded again."""
    refund = SyncEffect("refund", hold=True)

    def issue_refund(state: Order) -> Command[Any]:
        return Command(update={"done": [refund(state["order"])]}, goto="notify")

    builder = StateGraph(Order)
    builder.add_node("refund", lg.node(issue_refund), destinations=("notify",))
    builder.add_node("notify", lambda state: {"done": ["notified"]})
    builder.add_edge(START, "refund")
    builder.add_edge("notify", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    thread = f"lg10-damaged-node-{how.replace(' ', '-')}"
    with refund.released_at_exit():
        await cancel_while_held(ledger, graph, {"order": "1042"}, thread, refund)
    (op,) = await ledger.backend.operations(thread)
    damage(ledger_url, op.id, how)
    before = await ops(ledger, thread)

    with pytest.raises(stopline.NotReplayable) as refused:
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            await g.ainvoke(graph, None)
    assert refused.value.op_id == op.id
    assert "cannot be read back" in refused.value.why or "damaged" in refused.value.why
    assert refund.effects == ["1042"]  # not sent again
    assert await ops(ledger, thread) == before  # nothing new recorded


@pytest.mark.parametrize("how", DAMAGES)
async def test_a_tool_whose_kept_result_cannot_be_read_back_tells_the_model(
    ledger: stopline.Ledger, ledger_url: str, how: str
) -> None:
    """A tool's replay answers the model as any result not kept does (it raised the
    decoder's error out of the graph), and the tool is not called again."""
    refund = SyncEffect("refund", hold=True)

    def issue_refund(order: str) -> Command[Any]:
        """Refund an order."""
        message = ToolMessage(refund(order), tool_call_id="r1")
        return Command(update={"messages": [message]})

    graph = one_turn([call("issue_refund", "r1", order="9")], gated("gate", issue_refund))
    thread = f"lg10-damaged-tool-{how.replace(' ', '-')}"
    with refund.released_at_exit():
        await cancel_while_held(ledger, graph, {"messages": []}, thread, refund)
    damage(ledger_url, f"{thread}/tool:r1", how)
    before = await ops(ledger, thread)

    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        final = await g.ainvoke(graph, None)
    (answer,) = [m for m in final["messages"] if isinstance(m, ToolMessage)]
    assert "result was not kept" in str(answer.content)
    assert "Do not call it again" in str(answer.content)
    assert refund.effects == ["9"]
    assert await ops(ledger, thread) == before


# -- a result of the kept record's own shape --------------------------------------------
async def test_a_result_shaped_like_a_kept_record_comes_back_as_itself(
    ledger: stopline.Ledger,
) -> None:
    """An audit tool returns a record as another ledger holds it: a dict with the
    marker key and the kept record's keys. It was decoded as a kept record (the model
    was handed ``110``, the bytes' first value); now the tool's dict is the answer, when
    it runs and when it is replayed."""
    shaped = {MARKER: "msgpack", "data": "bm90ZQ==", "shows": "a refund of 9"}
    audit = SyncEffect("audit", hold=True)

    def export(order: str) -> dict[str, str]:
        """Export the ledger's record of an order."""
        audit(order)
        return dict(shaped)

    graph = one_turn([call("export", "e1", order="9")], gated("tool", export))
    async with lg.run(ledger, owner="user:1", thread_id="lg10-shaped-live") as g:
        audit.release.set()
        live = await g.ainvoke(graph, {"messages": []})
    (told,) = [m for m in live["messages"] if isinstance(m, ToolMessage)]
    assert json.loads(str(told.content)) == shaped

    audit = SyncEffect("audit", hold=True)
    graph = one_turn([call("export", "e2", order="9")], gated("tool", export))
    with audit.released_at_exit():
        await cancel_while_held(ledger, graph, {"messages": []}, "lg10-shaped", audit)
    async with lg.run(ledger, owner="user:1", thread_id="lg10-shaped") as g:
        final = await g.ainvoke(graph, None)
    (told,) = [m for m in final["messages"] if isinstance(m, ToolMessage)]
    assert json.loads(str(told.content)) == shaped  # replayed as itself
    assert audit.effects == ["9"]


# -- interrupt() in an sl.tool function -------------------------------------------------
@pytest.mark.parametrize("sync", [False, True], ids=["async", "def"])
async def test_interrupt_in_an_sl_tool_function_is_a_pause(
    ledger: stopline.Ledger, sync: bool
) -> None:
    """The pause was recorded ``unknown``, then sent to review, and the resumed graph
    raised ``OperationInDoubt``: the refund never happened. Now the attempt is
    ``not_committed``, the run paused for an approval of the call, and the approved
    resume with ``Command(resume=...)`` refunds once."""
    paid: list[str] = []

    def body(order: str) -> str:
        if not interrupt({"refund": order}):
            return "declined"
        paid.append(order)
        return f"refunded {order}"

    def refund(order: str) -> str:
        """Refund an order, once a person agrees."""
        return body(order)

    async def refund_async(order: str) -> str:
        """Refund an order, once a person agrees."""
        return body(order)

    refund_async.__name__ = "refund"  # the tool's name, as the model asks for it
    tool = refund if sync else refund_async
    graph = one_turn([call("refund", "r1", order="9")], gated("tool", tool))
    thread = f"lg10-tool-interrupt-{sync}"
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        first = await g.ainvoke(graph, {"messages": []})
    assert first["__interrupt__"]
    assert await ops(ledger, thread) == {"tool:r1": (OpStatus.NOT_COMMITTED, None)}
    assert (await ledger.receipt(thread)).run_state is RunState.PAUSED
    (approval,) = await ledger.backend.approvals(thread)
    assert approval.scope == f"{thread}/tool:r1"

    await approve_and_resume(ledger, thread)
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        final = await g.ainvoke(graph, Command(resume=True))
    assert paid == ["9"]
    assert final["messages"][-1].content == "done"
    assert await ops(ledger, thread) == {"tool:r1": (OpStatus.COMMITTED, "refunded 9")}
    assert (await ledger.receipt(thread)).headline is Headline.COMPLETED


# -- a ParentCommand out of a gated tool ------------------------------------------------
def transfer_tool(effect: SyncEffect) -> Any:
    """A def tool that transfers, then runs a handoff graph of its own, whose node hands
    a command to the graph running the tool (LangGraph's ``ParentCommand``)."""

    def hand_over(state: Order) -> Command[Any]:
        message = ToolMessage(f"transferred {state['order']}", tool_call_id="t1")
        update = {"routed": [f"handed {state['order']}"], "messages": [message]}
        return Command(graph=Command.PARENT, goto="elsewhere", update=update)

    builder = StateGraph(Order)
    builder.add_node("hand_over", hand_over)
    builder.add_edge(START, "hand_over")
    handoff = builder.compile()

    def transfer(order: str) -> str:
        """Transfer an order to another desk."""
        effect(order)
        handoff.invoke({"order": order})
        return "not reached: the handoff routes the graph"

    return transfer


@pytest.mark.parametrize("way", ["gate", "tool"])
async def test_a_tool_handing_a_command_to_its_graph_is_committed(
    ledger: stopline.Ledger, way: str
) -> None:
    """The tool ran to its end: it was recorded as a pause that did not happen
    (``sl.gate``, and the call was taken for one waiting on a person) or ``unknown``
    (``sl.tool``). Now ``committed`` with its command; the graph routes as it says."""
    transfers = SyncEffect("transfer")
    graph = one_turn([call("transfer", "t1", order="7")], gated(way, transfer_tool(transfers)))
    thread = f"lg10-handed-{way}"
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        final = await g.ainvoke(graph, {"messages": []})
        assert g.interrupted == []  # no approval to ask for: nothing waits
    assert final["routed"] == ["handed 7", "elsewhere"]
    ((status, result),) = (await ops(ledger, thread)).values()
    assert status is OpStatus.COMMITTED and result[MARKER] == "msgpack"
    receipt = await ledger.wait_settled(thread, timeout=10)
    assert receipt.headline is Headline.COMPLETED
    assert transfers.effects == ["7"]


@pytest.mark.parametrize("way", ["gate", "tool"])
async def test_a_tool_handing_a_command_is_replayed_not_run_again(
    ledger: stopline.Ledger, way: str
) -> None:
    """Cut while it ran (a def tool goes on in its thread, R4), it committed late; the
    resume ran the transfer again (``sl.gate``: recorded ``not_committed``) or stopped
    on ``OperationInDoubt`` (``sl.tool``). Now the replay hands the same command."""
    transfers = SyncEffect("transfer", hold=True)
    graph = one_turn([call("transfer", "t1", order="7")], gated(way, transfer_tool(transfers)))
    thread = f"lg10-handed-cut-{way}"
    with transfers.released_at_exit():
        await cancel_while_held(ledger, graph, {"messages": []}, thread, transfers)
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        final = await g.ainvoke(graph, None)
    assert transfers.effects == ["7"]  # not repeated
    assert final["routed"] == ["handed 7", "elsewhere"]  # the same command
    assert [m.content for m in final["messages"] if isinstance(m, ToolMessage)] == ["transferred 7"]
    assert (await ops(ledger, thread))["tool:t1"][0] is OpStatus.COMMITTED


@pytest.mark.parametrize("way", ["gate", "tool"])
async def test_a_handing_call_asked_again_routes_the_task_that_asks(
    ledger: stopline.Ledger, way: str
) -> None:
    """The model asks again with the same call id and arguments (the recorded call,
    ADR 0054): its replay hands the command to the tools task running now, not to the
    first one's namespace (a ``ParentCommand`` no task took, out of the graph)."""
    transfers = SyncEffect("transfer")
    again = [call("transfer", "t1", order="7")]
    graph = scripted([again, again], gated(way, transfer_tool(transfers)))
    async with lg.run(ledger, owner="user:1", thread_id=f"lg10-handed-again-{way}") as g:
        final = await g.ainvoke(graph, {"messages": []})
    assert transfers.effects == ["7"]
    assert final["routed"] == ["handed 7", "elsewhere", "handed 7", "elsewhere"]


# -- parallel calls of one ToolNode ------------------------------------------------------
async def test_parallel_calls_with_one_failing_are_recorded_and_never_repeated(
    ledger: stopline.Ledger,
) -> None:
    """``boom`` raises while ``pay`` still runs: the graph fails, ``pay`` goes on and
    commits (its record says so), ``boom`` is in doubt. The graph invoked again on its
    thread runs the node again: ``pay`` is replayed, ``boom`` is not sent again and the
    model is told why."""
    paid: list[str] = []
    paying, go = anyio.Event(), anyio.Event()

    async def pay(order: str) -> str:
        """Pay an order."""
        paying.set()
        await go.wait()
        paid.append(order)
        return f"paid {order}"

    async def boom(order: str) -> str:
        """Ship an order."""
        await paying.wait()
        raise RuntimeError("the carrier hung up")

    calls = [call("pay", "p1", order="1"), call("boom", "b1", order="1")]
    graph = one_turn(calls, gated("gate", pay, boom))
    thread = "lg10-parallel-fail"
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        with pytest.raises(RuntimeError, match="carrier"):
            await g.ainvoke(graph, {"messages": []})
        go.set()  # pay goes on after the graph failed
        await until_committed(ledger, f"{thread}/tool:p1")
        got = await ops(ledger, thread)
        assert got["tool:p1"] == (OpStatus.COMMITTED, "paid 1")
        assert got["tool:b1"][0] in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
        final = await g.ainvoke(graph, None)  # LangGraph runs the failed node again
    said = {m.tool_call_id: m for m in final["messages"] if isinstance(m, ToolMessage)}
    assert said["p1"].content == "paid 1"
    assert said["b1"].status == "error" and "was not sent" in str(said["b1"].content)
    assert paid == ["1"]
    assert (await ops(ledger, thread))["tool:p1"] == (OpStatus.COMMITTED, "paid 1")


async def test_parallel_calls_with_one_pausing_resume_without_repeating(
    ledger: stopline.Ledger,
) -> None:
    """``ask`` calls ``interrupt()`` once ``pay`` has paid: the pause is ``ask``'s alone
    (one approval), ``pay`` is committed; the approved resume replays ``pay``."""
    paid: list[str] = []
    done = anyio.Event()

    async def pay(order: str) -> str:
        """Pay an order."""
        paid.append(order)
        done.set()
        return f"paid {order}"

    async def ask(order: str) -> str:
        """Ask a person about an order."""
        await done.wait()
        return str(interrupt({"ship": order}))

    calls = [call("pay", "p1", order="1"), call("ask", "a1", order="1")]
    graph = one_turn(calls, gated("gate", pay, ask))
    thread = "lg10-parallel-pause"
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        await g.ainvoke(graph, {"messages": []})
    await until_committed(ledger, f"{thread}/tool:p1")
    assert (await ops(ledger, thread))["tool:a1"] == (OpStatus.NOT_COMMITTED, None)
    (approval,) = await ledger.backend.approvals(thread)
    assert approval.scope == f"{thread}/tool:a1"

    await approve_and_resume(ledger, thread)
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        final = await g.ainvoke(graph, Command(resume="ship it"))
    said = {m.tool_call_id: m.content for m in final["messages"] if isinstance(m, ToolMessage)}
    assert said == {"p1": "paid 1", "a1": "ship it"}
    assert paid == ["1"]
    assert (await ledger.receipt(thread)).headline is Headline.COMPLETED


# -- a subgraph --------------------------------------------------------------------------
async def test_a_subgraph_node_handing_a_command_to_its_parent_is_replayed_once(
    ledger: stopline.Ledger,
) -> None:
    """A gated node of a subgraph returns ``Command(graph=Command.PARENT)``; cut and
    resumed, its replay routes the parent graph, once, and the refund is not repeated."""
    refund = SyncEffect("refund", hold=True)

    def issue_refund(state: Order) -> Command[Any]:
        done = refund(state["order"])
        return Command(graph=Command.PARENT, goto="notify", update={"done": [done]})

    inner = StateGraph(Order)
    inner.add_node("refund", lg.node(issue_refund))
    inner.add_edge(START, "refund")
    outer = StateGraph(Order)
    outer.add_node("desk", inner.compile(), destinations=("notify",))
    outer.add_node("notify", lambda state: {"done": ["notified"]})
    outer.add_edge(START, "desk")
    outer.add_edge("notify", END)
    graph = outer.compile(checkpointer=InMemorySaver())
    with refund.released_at_exit():
        await cancel_while_held(ledger, graph, {"order": "5"}, "lg10-subgraph", refund)
    async with lg.run(ledger, owner="user:1", thread_id="lg10-subgraph") as g:
        final = await g.ainvoke(graph, None)
    assert final["done"] == ["refund:5", "notified"]
    assert refund.effects == ["5"]
    ((key, (status, _)),) = (await ops(ledger, "lg10-subgraph")).items()
    assert key.startswith("desk:") and "|refund:" in key and status is OpStatus.COMMITTED
