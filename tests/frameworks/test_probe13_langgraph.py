"""Probe 13 of the LangGraph adapter (ADR 0120): a repeat of a call the model was left
without an answer for, settled since; a turn cut by another entry ending its run under
it; and time travel (a graph invoked again from an earlier checkpoint).

Real graphs (``StateGraph``, ``ToolNode``, LangChain tools, ``GenericFakeChatModel``,
``InMemorySaver``), real ledgers on SQLite files and PostgreSQL; events, never sleeps.
"""

from __future__ import annotations

import operator
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypedDict

import anyio
import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool as lc_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Send

import stopline
from stopline import OpStatus, ReadBack, RunState, Verdict
from stopline.integrations import langgraph as lg
from tests.conftest import FAST_VERIFY
from tests.frameworks.test_probe11_langgraph import Shop, call, chat_graph, told
from tests.frameworks.test_probe12_langgraph import Gateway

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.parametrize("ledger_backend", ["sqlite", "postgres"], indirect=True),
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def other(ledger_url: str) -> AsyncIterator[stopline.Ledger]:
    """A second worker on the same ledger (its own runtime, as another process has)."""
    async with stopline.open(ledger_url, verify=FAST_VERIFY) as opened:
        yield opened


def charge_node(way: str, shop: Shop) -> ToolNode:
    """The charge alone, gated by ``sl.gate`` or as an ``sl.tool``; a raise is a message."""
    _, charge_fn = shop.tools()
    if way == "gate":
        hook = lg.gate(verify={"charge": shop.read_charge})
        return ToolNode([lc_tool(charge_fn)], awrap_tool_call=hook, handle_tool_errors=True)
    return ToolNode([lg.tool(charge_fn, verify=shop.read_charge)], handle_tool_errors=True)


async def settled(ledger: stopline.Ledger, op_id: str, status: OpStatus) -> None:
    run_id = op_id.partition("/")[0]
    while (await ledger.backend.get_operation(op_id)).status is not status:
        await ledger.wait_for_change(run_id)


async def notes(ledger: stopline.Ledger, op_id: str) -> list[dict[str, Any]]:
    """The ``repeat_answered`` notes on ``op_id``: a later call answered from it."""
    events = await ledger.backend.events(op_id.partition("/")[0])
    return [dict(e.data) for e in events if e.op_id == op_id and e.kind == "repeat_answered"]


# -- a repeat of a call the model was left without an answer for, settled since -------
@pytest.mark.parametrize("way", ["gate", "tool"])
async def test_a_repeat_of_a_call_read_back_as_done_since_is_answered_from_its_record(
    ledger: stopline.Ledger, way: str
) -> None:
    """Turn 1: the charge is done and its connection drops; ``ToolNode`` tells the model
    it failed (``unknown``), and a read-back settles it ``committed`` before the user
    writes again. Turn 2 ("try again"): the model asks again under a new call id. That
    repeat is the call the model was left without an answer for: answered from its
    record (done, read back), not sent, and the call is noted as answered. Turn 3: the
    same request once more is a new one (the model had its answer): sent.
    Before: a settled call was not matched, and turn 2 charged the card a second time."""
    shop = Shop(fail="after")
    replies = [
        AIMessage("", tool_calls=[call("charge", "c1", amount=5)]),
        AIMessage("the charge failed"),
        AIMessage("", tool_calls=[call("charge", "c9", amount=5)]),
        AIMessage("it was done already"),
        AIMessage("", tool_calls=[call("charge", "c10", amount=5)]),
        AIMessage("charged again"),
    ]
    graph = chat_graph(charge_node(way, shop), replies)
    thread = f"lg13-settled-{way}"
    first = f"{thread}/tool:c1"
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        state = await g.ainvoke(graph, {"messages": [("user", "charge 5")]})
    assert told(state, "c1").status == "error"  # the model was told it failed
    await settled(ledger, first, OpStatus.COMMITTED)  # the read-back, before the repeat

    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        state = await g.ainvoke(graph, {"messages": [("user", "try again")]})
    assert shop.sent("charge 5") == 1 and shop.done == ["charge 5"]  # not sent again
    answer = str(told(state, "c9").content)
    assert first in answer and "earlier run of this thread" in answer
    assert "not sent again" in answer and "committed" in answer
    assert "read-back proved it happened" in answer  # what the record rests on
    assert await ledger.backend.operations(g.id) == []  # nothing of turn 2's own
    assert await notes(ledger, first) == [{"by": f"{thread}@turn:2/tool:c9"}]

    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        state = await g.ainvoke(graph, {"messages": [("user", "and charge 5 more")]})
    assert shop.sent("charge 5") == 2  # a new request once the model had its answer
    assert told(state, "c10").content == "charged 5"
    assert (await ledger.backend.get_operation(f"{g.id}/tool:c10")).status is OpStatus.COMMITTED


@pytest.mark.parametrize("way", ["gate", "tool"])
async def test_a_call_answered_in_time_is_no_call_a_later_request_repeats(
    ledger: stopline.Ledger, way: str
) -> None:
    """The charge answered in its turn (the model had "charged 5"): the same request in a
    later turn is a new one, sent, and nothing is noted on the first. (The rule matches
    only a call the model was left without an answer for.)"""
    shop = Shop(fail="")
    replies = [
        AIMessage("", tool_calls=[call("charge", "c1", amount=5)]),
        AIMessage("charged"),
        AIMessage("", tool_calls=[call("charge", "c9", amount=5)]),
        AIMessage("charged again"),
    ]
    graph = chat_graph(charge_node(way, shop), replies)
    thread = f"lg13-in-time-{way}"
    for text in ("charge 5", "charge 5 more"):
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            state = await g.ainvoke(graph, {"messages": [("user", text)]})
    assert shop.sent("charge 5") == 2 and told(state, "c9").content == "charged 5"
    assert await notes(ledger, f"{thread}/tool:c1") == []


@pytest.mark.parametrize("way", ["gate", "tool"])
async def test_a_retry_answered_from_its_record_leaves_a_later_request_new(
    ledger: stopline.Ledger, way: str
) -> None:
    """The charge was done and its connection dropped, and the graph raised (no error
    message: the run ``failed``). LangGraph's retry runs the call again under its own id:
    read back, done, replayed (the model now has its answer), and noted so. A later
    turn's identical request is then a new one: sent. (Without the note it would be
    taken for a repeat of the call left without its answer, and not sent.)"""
    shop = Shop(fail="after")
    _, charge_fn = shop.tools()
    if way == "gate":
        hook = lg.gate(verify={"charge": shop.read_charge})
        tools = ToolNode([lc_tool(charge_fn)], awrap_tool_call=hook, handle_tool_errors=False)
    else:
        gated = lg.tool(charge_fn, verify=shop.read_charge)
        tools = ToolNode([gated], handle_tool_errors=False)
    replies = [
        AIMessage("", tool_calls=[call("charge", "c1", amount=5)]),
        AIMessage("charged"),
        AIMessage("", tool_calls=[call("charge", "c9", amount=5)]),
        AIMessage("charged again"),
    ]
    graph = chat_graph(tools, replies)
    thread = f"lg13-retry-{way}"
    first = f"{thread}/tool:c1"
    with pytest.raises(ConnectionError):
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            await g.ainvoke(graph, {"messages": [("user", "charge 5")]})
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        state = await g.ainvoke(graph, None)  # LangGraph's retry
    assert shop.sent("charge 5") == 1 and (await ledger.backend.get_run(thread)).state is (
        RunState.FAILED
    )
    assert "earlier run of this thread" in str(told(state, "c1").content)
    assert await notes(ledger, first) == [{"by": f"{thread}@turn:2/tool:c1"}]
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        state = await g.ainvoke(graph, {"messages": [("user", "charge 5 more")]})
    assert shop.sent("charge 5") == 2 and told(state, "c9").content == "charged 5"


# -- a turn cut by another entry ending the run under it ------------------------------
async def test_a_turn_cut_by_another_entry_ending_the_run_under_it_is_said(
    ledger: stopline.Ledger, other: stopline.Ledger
) -> None:
    """Worker A is in the thread's run; worker B (another runtime on the same ledger, as
    another process) reads it ``running`` and attaches. A leaves first: its block ends
    the run ``completed``. B's graph then reaches its charge: not sent (the gate refuses
    an ended run), and B's block raises ``RunEnded`` saying its turn was cut by another
    entry of the thread and to enter the thread again. Before: B's block ended quietly,
    its caller told nothing of a turn cut at its first call."""
    shop = Shop(fail="")
    replies = [AIMessage("", tool_calls=[call("charge", "c1", amount=5)]), AIMessage("done")]
    graph = chat_graph(charge_node("gate", shop), replies)
    thread = "lg13-cut"
    a_inside, b_inside, a_left = anyio.Event(), anyio.Event(), anyio.Event()
    outcome: list[BaseException | str] = []

    async def worker_a() -> None:
        async with lg.run(ledger, owner="user:1", thread_id=thread):
            a_inside.set()
            await b_inside.wait()
        a_left.set()

    async def worker_b() -> None:
        await a_inside.wait()
        try:
            async with lg.run(other, owner="user:1", thread_id=thread) as g:
                b_inside.set()
                await a_left.wait()
                await g.ainvoke(graph, {"messages": [("user", "charge 5")]})
            outcome.append("ended quietly")
        except stopline.StoplineError as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker_a)
        tg.start_soon(worker_b)
    (raised,) = outcome
    assert isinstance(raised, stopline.RunEnded), raised
    assert raised.run_id == thread and raised.state is RunState.COMPLETED
    assert f"another entry of thread {thread!r}" in str(raised) and "cut" in str(raised)
    assert "sl.run" in str(raised)
    assert shop.done == []  # not sent
    (op,) = await ledger.backend.operations(thread)
    assert op.status is OpStatus.PREVENTED
    async with lg.run(other, owner="user:1", thread_id=thread) as g:  # as it says
        state = await g.ainvoke(graph, None)
    assert g.id == f"{thread}@turn:2" and shop.done == ["charge 5"]
    assert told(state, "c1").content == "charged 5"


async def test_a_graph_cancelled_still_ends_its_block_quietly(ledger: stopline.Ledger) -> None:
    """A cancel of the run (``g.cancel``) at the charge's gate is no run ended under the
    turn: the block ends quietly, as before."""
    shop = Shop(fail="")
    replies = [AIMessage("", tool_calls=[call("charge", "c1", amount=5)]), AIMessage("done")]
    graph = chat_graph(charge_node("gate", shop), replies)
    async with lg.run(ledger, owner="user:1", thread_id="lg13-cancelled") as g:
        await g.cancel(by="user:1")
        await g.ainvoke(graph, {"messages": [("user", "charge 5")]})
        pytest.fail("the cancelled graph's block goes on")  # pragma: no cover
    assert shop.done == []
    assert (await ledger.backend.get_run("lg13-cancelled")).state is RunState.CANCELLED


# -- parallel node tasks through ``Send``: a retry, and an update a record cannot give --
class Payments(TypedDict, total=False):
    amounts: list[int]
    paid: Annotated[list[str], operator.add]


@pytest.mark.parametrize("fail", ["after", "before"])
async def test_a_send_task_retried_is_sent_once_and_never_handed_an_empty_update(
    ledger: stopline.Ledger, fail: str
) -> None:
    """Three ``Send`` tasks of one ``sl.node`` (pay 5, 7, 9); pay 7 raises out of the
    graph. LangGraph's retry re-runs only that task, under its task key: nothing paid
    twice. Refused before it was done (``before``), it is read back and paid once, and
    its update is in the state. Done and then dropped (``after``), the read-back proves
    it and holds no update: the retry raises ``NotReplayable`` naming it. Before: the
    retry went on with no update for it, the state saying 5 and 9 were paid and nothing
    of 7, with nothing said."""
    sent: list[int] = []
    dropped = [False]

    async def read(ctx: stopline.CallContext) -> ReadBack:
        verdict = Verdict.COMMITTED if 7 in sent else Verdict.NOT_COMMITTED
        return ReadBack(verdict, "gateway", "read back", ended=True)

    async def pay(state: dict[str, int]) -> dict[str, list[str]]:
        amount = state["amount"]
        if amount == 7 and not dropped[0]:
            dropped[0] = True
            if fail == "after":
                sent.append(amount)
            raise ConnectionError("connection reset")
        sent.append(amount)
        return {"paid": [f"paid {amount}"]}

    def fan_out(state: Payments) -> list[Send]:
        return [Send("pay", {"amount": a}) for a in state["amounts"]]

    builder = StateGraph(Payments)
    builder.add_node("pay", lg.node(verify=read)(pay))
    builder.add_conditional_edges(START, fan_out, ["pay"])
    builder.add_edge("pay", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    thread = f"lg13-send-{fail}"
    with pytest.raises(ConnectionError):
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            await g.ainvoke(graph, {"amounts": [5, 7, 9]})
    if fail == "before":
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            state = await g.ainvoke(graph, None)
        assert sorted(sent) == [5, 7, 9]
        assert sorted(state["paid"]) == ["paid 5", "paid 7", "paid 9"]
        return
    with pytest.raises(stopline.NotReplayable) as refused:
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            await g.ainvoke(graph, None)
    assert sorted(sent) == [5, 7, 9]  # 7 once: read back, not sent again
    assert refused.value.op_id.startswith(f"{thread}/pay:")
    assert "read-back proved it happened" in str(refused.value)
    record = await ledger.backend.get_operation(refused.value.op_id)
    assert record.status is OpStatus.COMMITTED and not record.has_result


async def test_a_node_resumed_after_a_read_back_is_not_handed_an_empty_update(
    ledger: stopline.Ledger,
) -> None:
    """An async ``sl.node`` cut by a cancel while its provider held the request: the
    read-back proves it done (``committed``, no update kept). The resumed run re-runs the
    node's task under the same key: not sent again, and ``NotReplayable`` names it.
    Before: the node returned nothing, and the graph went on without its update."""
    reached, sent = anyio.Event(), []

    async def read(ctx: stopline.CallContext) -> ReadBack:
        return ReadBack(Verdict.COMMITTED, "gateway", "read back", ended=True)

    async def refund(state: Payments) -> dict[str, list[str]]:
        sent.append("refund")
        reached.set()
        await anyio.sleep_forever()  # the provider holds it: only the cancel ends it
        return {"paid": ["refunded"]}  # pragma: no cover

    builder = StateGraph(Payments)
    builder.add_node("refund", lg.node(verify=read)(refund))
    builder.add_edge(START, "refund")
    builder.add_edge("refund", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    thread = "lg13-node-read-back"
    async with anyio.create_task_group() as tg:

        async def invoke() -> None:
            async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
                holder.append(g)
                await g.ainvoke(graph, {"amounts": []})

        holder: list[lg.GraphRun] = []
        tg.start_soon(invoke)
        await reached.wait()
        await holder[0].cancel(by="user:1")
    receipt = await ledger.wait_settled(thread, timeout=10)
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    await ledger.resume(thread, by="user:1")
    with pytest.raises(stopline.NotReplayable) as refused:
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            await g.ainvoke(graph, None)
    assert sent == ["refund"] and refused.value.op_id == receipt.lines[0].op_id


async def test_a_repeat_of_a_call_whose_own_answer_came_after_its_run_ended_is_not_sent(
    ledger: stopline.Ledger,
) -> None:
    """The email raised out of the graph while the charge (a ``def`` tool) was at work in
    its thread: the run ended ``failed`` with the charge ``requested``, and no answer of
    it reached the model. Its own answer then lands (``committed``, after its run
    ended). The user writes again and the model asks for the charge under a new id: that
    is the call it had no answer for, answered from its record, not sent.
    Before: a call settled was not matched, and the card was charged twice."""
    gw = Gateway()
    charge_tool, email_tool = gw.tools()
    hook = lg.gate(verify={"charge": gw.read_charge, "send_email": gw.read_email})
    tools = ToolNode([charge_tool, email_tool], awrap_tool_call=hook)
    calls = [call("charge", "c1", amount=5), call("send_email", "c2", to="a@x")]
    replies = [
        AIMessage("", tool_calls=calls),
        AIMessage("", tool_calls=[call("charge", "c9", amount=5)]),
        AIMessage("done"),
    ]
    graph = chat_graph(tools, replies)
    thread = "lg13-late"
    charge = f"{thread}/tool:c1"
    try:
        with pytest.raises(ConnectionError):
            async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
                await g.ainvoke(graph, {"messages": [("user", "charge and email")]})
        assert (await ledger.backend.get_operation(charge)).status is OpStatus.REQUESTED
    finally:
        gw.release.set()
    await settled(ledger, charge, OpStatus.COMMITTED)  # its own answer (R4), run over
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        state = await g.ainvoke(graph, {"messages": [("user", "did it go through?")]})
    assert gw.charges == [5]  # once
    answer = str(told(state, "c9").content)
    assert charge in answer and "not sent again" in answer and "charged 5" in answer
    assert await notes(ledger, charge) == [{"by": f"{thread}@turn:2/tool:c9"}]


# -- time travel: a graph invoked again from an earlier checkpoint ---------------------
async def forked(ledger: stopline.Ledger, graph: Any, thread: str) -> tuple[str, Any]:
    """The thread's graph invoked again from its checkpoint before the tool node ran
    (LangGraph's time travel: ``config`` with that ``checkpoint_id``), in ``sl.run``."""
    config = {"configurable": {"thread_id": thread}}
    history = [h async for h in graph.aget_state_history(config)]
    before = next(h for h in history if h.next == ("tools",))
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        state = await g.ainvoke(graph, None, before.config)
    return g.id, state


@pytest.mark.parametrize("way", ["gate", "tool"])
async def test_time_travel_to_before_a_tool_call_replays_it(
    ledger: stopline.Ledger, way: str
) -> None:
    """The charge ran; the graph is invoked again from the checkpoint before its tool
    node (its call under the same id): replayed from its record, not sent; the model
    gets its recorded answer."""
    shop = Shop(fail="")
    replies = [
        AIMessage("", tool_calls=[call("charge", "c1", amount=5)]),
        AIMessage("charged"),
        AIMessage("charged (again)"),
    ]
    graph = chat_graph(charge_node(way, shop), replies)
    thread = f"lg13-travel-{way}"
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        await g.ainvoke(graph, {"messages": [("user", "charge 5")]})
    run_id, state = await forked(ledger, graph, thread)
    assert run_id == f"{thread}@turn:2" and shop.sent("charge 5") == 1
    assert told(state, "c1").content == "charged 5"
    assert await ledger.backend.operations(run_id) == []


async def test_time_travel_with_a_tool_call_edited_after_it_ran_is_refused(
    ledger: stopline.Ledger,
) -> None:
    """The charge ran; the tool call is then edited at the checkpoint before its tool
    node (``update_state``: another amount under the same id) and the graph invoked from
    there: a reused id with other arguments, refused (``InvalidInput``, which this
    ``ToolNode`` makes the model's error message), nothing sent."""
    shop = Shop(fail="")
    replies = [
        AIMessage("", tool_calls=[call("charge", "c1", amount=5)]),
        AIMessage("ok"),
        AIMessage("refused"),
    ]
    graph = chat_graph(charge_node("gate", shop), replies)
    thread = "lg13-travel-edited"
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        await g.ainvoke(graph, {"messages": [("user", "charge 5")]})
    history = [h async for h in graph.aget_state_history(g.config)]
    before = next(h for h in history if h.next == ("tools",))
    asked = before.values["messages"][-1]
    edited = AIMessage("", id=asked.id, tool_calls=[call("charge", "c1", amount=6)])
    config = await graph.aupdate_state(before.config, {"messages": [edited]}, as_node="agent")
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        state = await g.ainvoke(graph, None, config)
    answer = told(state, "c1")
    assert answer.status == "error" and "InvalidInput" in str(answer.content)
    assert "reuses the id" in str(answer.content) and "nothing was sent" in str(answer.content)
    assert shop.log == ["send charge 5"]  # the edited call was not sent
    assert await ledger.backend.operations(g.id) == []
