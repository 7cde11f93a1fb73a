"""Probe 11 of the LangGraph adapter: a thread outlives its stopline run (ADR 0107).

**A retry after an error.** A graph that raises out of ``sl.run`` ends its run
``failed``, and a failed run cannot be entered again. LangGraph's own retry is
``graph.ainvoke(None, config)`` on the same thread: it runs the failed superstep again
from the last checkpoint, and a ``ToolNode`` whose one call raised runs *all* its
calls again. ``sl.run`` on the thread raised ``RunEnded`` ("start a new run (its
actions get new keys)"); following it, every key was new, and the sibling call that
had committed was sent a second time. Now ``sl.run(thread_id=T)`` opens the thread's
next run (``T@turn:2``), and a call an earlier run recorded is answered from that
record: one that happened is replayed, not sent; one in doubt is read back first, then
replayed, sent, or refused (nothing sent, the model told); one that did not happen is
sent in the new run.

**A new message on a thread whose run completed** raised ``RunEnded`` too: a user had to
invent a run id per turn. Now each turn is the thread's next run, found again by id.

A run of the thread that was cancelled keeps its rule (R10): resumed first, then entered
again, by the thread or by its own id, as its recovery line says.

Real graphs (``StateGraph``, ``ToolNode``, LangChain tools, ``GenericFakeChatModel``,
``InMemorySaver``), real ledgers on SQLite files and PostgreSQL; events, never sleeps.
"""

from __future__ import annotations

import operator
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, TypedDict

import anyio
import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.tools import tool as lc_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode

import stopline
from stopline import EvidenceKind, Headline, OpStatus, ReadBack, RunState, Verdict
from stopline.integrations import langgraph as lg
from tests.conftest import FAST_VERIFY
from tests.frameworks.effects import SyncEffect, until_unknown
from tests.mcp.conftest import Server, open_server, wait_status

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.parametrize("ledger_backend", ["sqlite", "postgres"], indirect=True),
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    """stopline's testing MCP server over real stdio, with its own record of effects."""
    async for opened in open_server("stdio-legacy", tmp_path_factory.mktemp("lg11-mcp")):
        yield opened


WAYS = ["gate", "tool"]  # ``ToolNode(awrap_tool_call=sl.gate())``, or each an ``sl.tool``


class Chat(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


class Order(TypedDict, total=False):
    order: str
    done: Annotated[list[str], operator.add]


def call(name: str, call_id: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "args": args, "id": call_id, "type": "tool_call"}


class Shop:
    """The destination, with its own record (``done``): an email provider and a payment
    gateway. ``charge`` fails once, as ``fail`` says: ``"before"`` (refused, nothing
    done), ``"after"`` (done, then the connection dropped) or ``""`` (never)."""

    def __init__(self, fail: str) -> None:
        self.fail = fail
        self.done: list[str] = []
        self.log: list[str] = []  # what was sent and read, in order
        self.answers = True  # whether the gateway can be read back

    def tools(self) -> list[Callable[..., str]]:
        def send_email(to: str) -> str:
            """Send an email."""
            self.log.append(f"send email {to}")
            self.done.append(f"email {to}")
            return f"sent to {to}"

        def charge(amount: int) -> str:
            """Charge the card."""
            self.log.append(f"send charge {amount}")
            fail, self.fail = self.fail, ""
            if fail == "before":
                raise ConnectionError("gateway refused the connection")
            self.done.append(f"charge {amount}")
            if fail == "after":
                raise ConnectionError("connection reset after the request was sent")
            return f"charged {amount}"

        return [send_email, charge]

    async def read_charge(self, ctx: stopline.CallContext) -> ReadBack:
        """The gateway's own record of the charge (its request has ended either way)."""
        self.log.append("read charge")
        if not self.answers:
            return ReadBack(Verdict.UNKNOWN, "gateway", "the gateway does not answer")
        there = any(d.startswith("charge") for d in self.done)
        verdict = Verdict.COMMITTED if there else Verdict.NOT_COMMITTED
        return ReadBack(verdict, "gateway", "read back", ended=True)

    def sent(self, what: str) -> int:
        return sum(1 for line in self.log if line == f"send {what}")


def tool_node(way: str, shop: Shop) -> ToolNode:
    email, charge = shop.tools()
    if way == "gate":
        hook = lg.gate(verify={"charge": shop.read_charge})
        return ToolNode([lc_tool(email), lc_tool(charge)], awrap_tool_call=hook)
    return ToolNode([lg.tool(email), lg.tool(charge, verify=shop.read_charge)])


def chat_graph(tools: ToolNode, replies: list[AIMessage]) -> Any:
    """agent (``GenericFakeChatModel``, its replies in order) -> tools -> agent."""
    model = GenericFakeChatModel(messages=iter(replies))

    async def agent(state: Chat) -> dict[str, list[AnyMessage]]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    def route(state: Chat) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

    builder = StateGraph(Chat)
    builder.add_node("agent", agent)
    builder.add_node("tools", tools)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", route, ["tools", END])
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=InMemorySaver())


def email_and_charge(way: str, shop: Shop) -> Any:
    """One message asking for both calls (one ``ToolNode`` task runs them), then done."""
    calls = [call("send_email", "c1", to="a@x"), call("charge", "c2", amount=5)]
    replies = [AIMessage("", tool_calls=calls), AIMessage("done")]
    return chat_graph(tool_node(way, shop), replies)


async def fails_once(ledger: stopline.Ledger, graph: Any, thread: str) -> None:
    """The first entry: the charge raises out of the graph and the run ends ``failed``."""
    with pytest.raises(ConnectionError):
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            await g.ainvoke(graph, {"messages": [("user", "email and charge")]})
    run = await ledger.backend.get_run(thread)
    assert run.state is RunState.FAILED
    ops = {op.id: op.status for op in await ledger.backend.operations(thread)}
    assert ops[f"{thread}/tool:c1"] is OpStatus.COMMITTED


async def retried(ledger: stopline.Ledger, graph: Any, thread: str) -> tuple[str, Any]:
    """LangGraph's retry on the same thread, in ``sl.run`` on the thread."""
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        state = await g.ainvoke(graph, None)
    return g.id, state


def told(state: Any, call_id: str) -> ToolMessage:
    (message,) = [
        m for m in state["messages"] if isinstance(m, ToolMessage) and m.tool_call_id == call_id
    ]
    return message


# -- a retry after an error ----------------------------------------------------------
@pytest.mark.parametrize("way", WAYS)
async def test_a_retry_on_the_thread_sends_only_what_did_not_happen(
    ledger: stopline.Ledger, way: str
) -> None:
    """The charge was refused before it was done; the email was sent. The retry (a new
    run of the thread) does not send the email again, reads the charge back, and sends
    it once. Before: ``RunEnded``, and a new run id sent the email twice."""
    shop = Shop(fail="before")
    graph = email_and_charge(way, shop)
    thread = f"lg11-retry-{way}"
    await fails_once(ledger, graph, thread)

    run_id, state = await retried(ledger, graph, thread)
    assert run_id == f"{thread}@turn:2"
    assert sorted(shop.done) == ["charge 5", "email a@x"]  # each once
    assert shop.sent("email a@x") == 1 and shop.sent("charge 5") == 2
    resent = len(shop.log) - 1 - shop.log[::-1].index("send charge 5")
    assert "read charge" in shop.log[:resent]  # read back before it was sent again
    assert told(state, "c1").content == "sent to a@x"  # the recorded answer, replayed
    assert told(state, "c2").content == "charged 5"
    assert state["messages"][-1].content == "done"

    first = {op.id: op.status for op in await ledger.backend.operations(thread)}
    assert first == {
        f"{thread}/tool:c1": OpStatus.COMMITTED,
        f"{thread}/tool:c2": OpStatus.NOT_COMMITTED,
    }
    second = await ledger.receipt(run_id)
    assert second.headline is Headline.COMPLETED and second.run_state is RunState.COMPLETED
    assert [(line.op_id, line.status) for line in second.lines] == [
        (f"{run_id}/tool:c2", OpStatus.COMMITTED)  # the email is the first run's, not again
    ]


@pytest.mark.parametrize("way", WAYS)
async def test_a_retry_does_not_send_a_call_the_read_back_finds_done(
    ledger_url: str, way: str
) -> None:
    """The charge was done and then its connection dropped (``unknown``); the worker
    stopped. The retry, in another worker on the same ledger and checkpoints, reads it
    back, finds it, and replays it: charged once, emailed once."""
    shop = Shop(fail="after")
    graph = email_and_charge(way, shop)
    thread = f"lg11-done-{way}"
    async with stopline.open(ledger_url, verify=FAST_VERIFY) as first:
        await fails_once(first, graph, thread)

    async with stopline.open(ledger_url, verify=FAST_VERIFY) as ledger:
        run_id, state = await retried(ledger, graph, thread)
        charge = await ledger.backend.get_operation(f"{thread}/tool:c2")
        assert await ledger.backend.operations(run_id) == []  # nothing sent in the retry
    assert sorted(shop.done) == ["charge 5", "email a@x"]
    assert shop.sent("email a@x") == 1 and shop.sent("charge 5") == 1
    assert shop.log.count("read charge") >= 1
    assert charge.status is OpStatus.COMMITTED
    assert EvidenceKind.READ_BACK in {e.kind for e in charge.evidence}
    note = str(told(state, "c2").content)  # it happened; its answer was never recorded
    assert "earlier run of this thread" in note and "not kept" in note


async def test_a_retry_does_not_upload_again_an_mcp_call_that_committed(
    ledger: stopline.Ledger, server: Server
) -> None:
    """``sl.mcp_tools`` beside a tool that raised: the retry answers the upload from the
    first run's record (it was sent again under the retry run's key before); the
    server's own record holds one upload."""
    shop = Shop(fail="before")
    _, charge = shop.tools()
    tools = ToolNode(
        [*lg.mcp_tools(server.conn, include={"upload"}), lg.tool(charge, verify=shop.read_charge)]
    )
    calls = [call("upload", "m1", payload="Q3 report"), call("charge", "m2", amount=5)]
    graph = chat_graph(tools, [AIMessage("", tool_calls=calls), AIMessage("done")])
    thread = "lg11-mcp"
    with pytest.raises(ConnectionError):
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            await g.ainvoke(graph, {"messages": [("user", "upload and charge")]})
    # the upload runs beside the graph, in the ledger's task group: it ends on its own
    await wait_status(ledger, f"{thread}/tool:m1", OpStatus.COMMITTED)

    run_id, state = await retried(ledger, graph, thread)
    assert len(await server.effects_of(f"{thread}/tool:m1")) == 1
    assert await server.effects_of(f"{run_id}/tool:m1") == []  # not sent again
    assert shop.done == ["charge 5"]
    assert state["messages"][-1].content == "done"
    assert [op.id for op in await ledger.backend.operations(run_id)] == [f"{run_id}/tool:m2"]


async def test_a_retry_refuses_a_call_still_in_doubt_and_says_so(
    ledger: stopline.Ledger,
) -> None:
    """The gateway cannot be read back: the charge is not sent again, and the model is
    told it is awaiting confirmation (``sl.gate``), the email replayed."""
    shop = Shop(fail="after")
    shop.answers = False
    graph = email_and_charge("gate", shop)
    thread = "lg11-doubt-gate"
    await fails_once(ledger, graph, thread)

    run_id, state = await retried(ledger, graph, thread)
    assert shop.sent("email a@x") == 1 and shop.sent("charge 5") == 1
    note = told(state, "c2")
    assert note.status == "error"
    assert f"{thread}/tool:c2" in str(note.content) and "not sent again" in str(note.content)
    assert "earlier run of this thread" in str(note.content)
    charge = await ledger.backend.get_operation(f"{thread}/tool:c2")
    assert not charge.status.settled or charge.status is OpStatus.NEEDS_REVIEW
    assert await ledger.backend.operations(run_id) == []


async def test_an_sl_tool_in_doubt_stops_the_retry_until_a_reviewer_decides(
    ledger: stopline.Ledger,
) -> None:
    """Under ``sl.tool`` a call in doubt raises ``OperationInDoubt`` (nothing sent), as
    in one run; once a reviewer decides it did not happen, the next retry sends it."""
    shop = Shop(fail="before")
    shop.answers = False
    graph = email_and_charge("tool", shop)
    thread = "lg11-doubt-tool"
    await fails_once(ledger, graph, thread)

    with pytest.raises(stopline.OperationInDoubt) as doubt:
        await retried(ledger, graph, thread)
    assert doubt.value.op_id == f"{thread}/tool:c2"
    assert shop.sent("charge 5") == 1 and shop.sent("email a@x") == 1
    assert (await ledger.backend.get_run(f"{thread}@turn:2")).state is RunState.FAILED

    charge = f"{thread}/tool:c2"
    while (await ledger.backend.get_operation(charge)).status is not OpStatus.NEEDS_REVIEW:
        await ledger.wait_for_change(thread)  # its read-backs spent: a reviewer's
    await ledger.resolve_review(charge, "not_committed", by="user:1", note="no charge")
    run_id, state = await retried(ledger, graph, thread)
    assert run_id == f"{thread}@turn:3"
    assert sorted(shop.done) == ["charge 5", "email a@x"]
    assert shop.sent("email a@x") == 1 and shop.sent("charge 5") == 2
    assert told(state, "c2").content == "charged 5"


async def test_a_node_cut_by_its_siblings_error_is_replayed_by_the_retry(
    ledger: stopline.Ledger,
) -> None:
    """An ``sl.node`` whose sync body was still at work when a sibling node of its
    superstep raised: LangGraph cancelled it, it committed late (R4), and the run ended
    ``failed``. The retry runs that superstep again: the refund is replayed, not made
    twice; the sibling runs again and succeeds."""
    refund = SyncEffect("refund", hold=True)
    flaky = {"fail": True}

    def issue_refund(state: Order) -> dict[str, list[str]]:
        return {"done": [refund(state["order"])]}

    async def notify(state: Order) -> dict[str, list[str]]:
        await refund.wait_reached()  # the refund is at work in its thread
        if flaky.pop("fail", False):
            raise ConnectionError("the notifier is down")
        return {"done": ["notified"]}

    builder = StateGraph(Order)
    builder.add_node("refund", lg.node(issue_refund))
    builder.add_node("notify", notify)
    builder.add_edge(START, "refund")
    builder.add_edge(START, "notify")
    builder.add_edge("refund", END)
    builder.add_edge("notify", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    thread = "lg11-node"
    with refund.released_at_exit():
        with pytest.raises(ConnectionError):
            async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
                await g.ainvoke(graph, {"order": "1042"})
        (op,) = await ledger.backend.operations(thread)
        await until_unknown(ledger, op.id)
        refund.release.set()  # it commits after the graph gave up on it (R4)
        while (await ledger.backend.get_operation(op.id)).status is not OpStatus.COMMITTED:
            await ledger.wait_for_change(thread)
    assert (await ledger.backend.get_run(thread)).state is RunState.FAILED

    run_id, state = await retried(ledger, graph, thread)
    assert refund.effects == ["1042"]  # refunded once
    assert sorted(state["done"]) == ["notified", "refund:1042"]
    assert await ledger.backend.operations(run_id) == []


# -- a new message on a thread whose run completed -------------------------------------
async def test_each_new_message_on_a_thread_is_its_next_run(ledger: stopline.Ledger) -> None:
    """Turn 1 completes; turn 2 and turn 3 (new user messages on the same thread) each
    run in the thread's next run, found by the thread id alone, and send their own
    calls. Before: ``RunEnded`` at turn 2."""
    shop = Shop(fail="")
    replies = [
        AIMessage("", tool_calls=[call("send_email", "c1", to="a@x")]),
        AIMessage("sent"),
        AIMessage("", tool_calls=[call("send_email", "c2", to="b@x")]),
        AIMessage("sent again"),
        AIMessage("nothing to do"),
    ]
    graph = chat_graph(tool_node("gate", shop), replies)
    thread = "lg11-turns"
    ids = []
    for text in ("email a", "email b", "thanks"):
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            await g.ainvoke(graph, {"messages": [("user", text)]})
        ids.append(g.id)
    assert ids == [thread, f"{thread}@turn:2", f"{thread}@turn:3"]
    assert shop.done == ["email a@x", "email b@x"]
    for run_id, key in ((thread, "tool:c1"), (f"{thread}@turn:2", "tool:c2")):
        receipt = await ledger.receipt(run_id)
        assert receipt.headline is Headline.COMPLETED
        assert [line.op_id for line in receipt.lines] == [f"{run_id}/{key}"]
    assert not (await ledger.receipt(f"{thread}@turn:3")).lines


async def test_a_thread_of_many_runs_is_entered_at_its_current_one(
    ledger: stopline.Ledger,
) -> None:
    """Past the first batch of 16 (and the next of 32) the thread's current run is
    still found: 50 entries are ``T``, ``T@turn:2`` ... ``T@turn:50``, each new."""
    thread = "lg11-many"
    ids = []
    for _ in range(50):
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            pass
        ids.append(g.id)
    assert ids == [thread, *(f"{thread}@turn:{n}" for n in range(2, 51))]
    runs = await ledger.backend.get_runs(ids)
    assert all(runs[i].state is RunState.COMPLETED for i in ids)


async def test_a_reused_call_id_with_other_arguments_in_a_later_turn_is_refused(
    ledger: stopline.Ledger,
) -> None:
    """A model that reuses a call id in a later turn with other arguments: refused
    before sending (ADR 0054, now across the thread's runs), nothing sent."""
    shop = Shop(fail="")
    replies = [
        AIMessage("", tool_calls=[call("send_email", "c1", to="a@x")]),
        AIMessage("sent"),
        AIMessage("", tool_calls=[call("send_email", "c1", to="b@x")]),
    ]
    graph = chat_graph(tool_node("gate", shop), replies)
    thread = "lg11-reused"
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        await g.ainvoke(graph, {"messages": [("user", "email a")]})
    with pytest.raises(stopline.InvalidInput, match="earlier run of this thread"):
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            await g.ainvoke(graph, {"messages": [("user", "email b")]})
    assert shop.done == ["email a@x"]


# -- a cancelled run of the thread keeps its rule (R10) --------------------------------
async def test_a_cancelled_later_run_is_resumed_then_entered_as_its_guidance_says(
    ledger: stopline.Ledger,
) -> None:
    """Turn 2 is cancelled while its call is at work: re-entering the thread raises
    ``RunEnded`` naming that run and saying to resume it first; after the resume, the
    thread (or the run's own id, "the same run id") enters it and nothing is repeated."""
    refund = SyncEffect("refund", hold=False)

    def issue_refund(order: str) -> str:
        """Refund an order."""
        return refund(order)

    replies = [
        AIMessage("", tool_calls=[call("issue_refund", "r1", order="1")]),
        AIMessage("refunded"),
        AIMessage("", tool_calls=[call("issue_refund", "r2", order="2")]),
        AIMessage("refunded again"),
    ]
    graph = chat_graph(ToolNode([lc_tool(issue_refund)], awrap_tool_call=lg.gate()), replies)
    thread = "lg11-cancelled"
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        await g.ainvoke(graph, {"messages": [("user", "refund 1")]})
    second = f"{thread}@turn:2"

    refund.hold = True
    with refund.released_at_exit():
        async with anyio.create_task_group() as tg:
            handles: list[lg.GraphRun] = []

            async def turn() -> None:
                async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
                    handles.append(g)
                    await g.ainvoke(graph, {"messages": [("user", "refund 2")]})

            tg.start_soon(turn)
            await refund.wait_reached()
            await handles[0].cancel(by="user:1")
            await until_unknown(ledger, f"{second}/tool:r2")
            refund.release.set()  # it commits after the cancel (R4)
    await ledger.wait_settled(second, timeout=20)

    with pytest.raises(stopline.RunEnded) as ended:
        async with lg.run(ledger, owner="user:1", thread_id=thread):
            pass
    assert ended.value.run_id == second and ended.value.state is RunState.CANCELLED
    assert "ledger.resume" in ended.value.what_to_do and "same run id" in ended.value.what_to_do

    await ledger.resume(second, by="user:1")
    async with lg.run(ledger, owner="user:1", thread_id=thread, run_id=second) as g:
        assert g.id == second  # "re-enter the run with the same run id"
        state = await g.ainvoke(graph, None)
    assert refund.effects == ["1", "2"]
    assert state["messages"][-1].content == "refunded again"
    assert (await ledger.receipt(second)).run_state is RunState.COMPLETED


async def test_a_thread_id_too_long_for_a_suffix_has_later_runs_too(
    ledger: stopline.Ledger,
) -> None:
    """A thread id that leaves no room for ``@turn:N`` (and an operation's key): its later
    runs' ids are its printable start and a digest, found again the same way."""
    shop = Shop(fail="")
    replies = [
        AIMessage("", tool_calls=[call("send_email", "c1", to="a@x")]),
        AIMessage("sent"),
        AIMessage("", tool_calls=[call("send_email", "c2", to="b@x")]),
        AIMessage("sent again"),
    ]
    graph = chat_graph(tool_node("gate", shop), replies)
    thread = "lg11-long-" + "x" * 900
    ids = []
    for text in ("email a", "email b"):
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            await g.ainvoke(graph, {"messages": [("user", text)]})
        ids.append(g.id)
    assert ids[0] == thread and "#sha256:" in ids[1] and len(ids[1]) <= 1024 - 256
    assert shop.done == ["email a@x", "email b@x"]
    assert (await ledger.backend.get_run(ids[1])).state is RunState.COMPLETED
