"""Probe 12 of the LangGraph adapter: a thread entered by two workers at once, a call of
an earlier run still running when the retry comes, and a new turn repeating a call an
earlier run left in doubt (ADR 0112).

Real graphs (``StateGraph``, ``ToolNode``, LangChain tools, ``GenericFakeChatModel``,
``InMemorySaver``), real ledgers on SQLite files and PostgreSQL; events, never sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool as lc_tool
from langgraph.prebuilt import ToolNode

import stopline
from stopline import OpStatus, ReadBack, RunState, Verdict
from stopline.integrations import langgraph as lg
from tests.conftest import FAST_VERIFY
from tests.frameworks.effects import BARRIER_LIMIT
from tests.frameworks.test_probe11_langgraph import Shop, call, chat_graph, told
from tests.support.held_reads import held_reads

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


async def enter_once(
    worker: stopline.Ledger, thread: str, outcomes: list[str | BaseException], leave: anyio.Event
) -> None:
    """One entry of ``thread``: in ``outcomes``, the run it entered or its error. An entry
    stays in its run until both have an outcome (``leave``)."""
    try:
        async with lg.run(worker, owner="user:1", thread_id=thread) as g:
            outcomes.append(g.id)
            if len(outcomes) == 2:
                leave.set()
            await leave.wait()
    except stopline.StoplineError as exc:
        outcomes.append(exc)
        if len(outcomes) == 2:
            leave.set()


# -- two workers entering one thread at once ---------------------------------------
async def test_a_run_that_ends_while_another_worker_enters_leads_to_the_next_run(
    ledger: stopline.Ledger, other: stopline.Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker B reads the thread's current run while worker A is in it; A's turn ends
    before B enters. B enters the thread's next run. Before: ``RunEnded`` with "start a
    new run (its actions get new keys)", guidance that is wrong for a thread."""
    thread = "lg12-ended"
    inside, leave, b_read, b_go = anyio.Event(), anyio.Event(), anyio.Event(), anyio.Event()

    async def after() -> None:
        b_read.set()
        await b_go.wait()

    ids: dict[str, str] = {}

    async def worker_a() -> None:
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            inside.set()
            await leave.wait()
        ids["a"] = g.id

    async def worker_b() -> None:
        async with lg.run(other, owner="user:1", thread_id=thread) as g:
            pass
        ids["b"] = g.id

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker_a)
        await inside.wait()
        held_reads(monkeypatch, other, after)
        tg.start_soon(worker_b)
        await b_read.wait()  # B has read: the current run is A's, running
        leave.set()
        while (await ledger.backend.get_run(thread)).state is not RunState.COMPLETED:
            await ledger.wait_for_change(thread)
        b_go.set()
    assert ids == {"a": thread, "b": f"{thread}@turn:2"}
    assert (await ledger.backend.get_run(f"{thread}@turn:2")).state is RunState.COMPLETED


@pytest.mark.parametrize("workers", ["two tasks", "two workers"])
async def test_two_entries_at_once_one_enters_the_other_is_told_to_retry(
    ledger: stopline.Ledger,
    other: stopline.Ledger,
    monkeypatch: pytest.MonkeyPatch,
    workers: str,
) -> None:
    """Two entries of one thread read its runs at the same moment (a new thread, then a
    completed one): one enters the run, the other gets ``LedgerLocked`` naming the
    thread and the run and saying to retry once that turn has ended, with nothing
    written; its retry then enters the thread's next run. Before: a raw duplicate-key
    ``LedgerRefused`` / ``LedgerError`` (or ``AlreadyAttached``: "use the Run object it
    gave"), or both inside one run, where the first to leave ends it under the other."""
    second = ledger if workers == "two tasks" else other
    thread = "lg12-at-once"
    for expected in (thread, f"{thread}@turn:2"):  # a new thread, then a completed one
        both_read = anyio.Event()
        reads = [0]

        async def after(reads: list[int] = reads, both_read: anyio.Event = both_read) -> None:
            reads[0] += 1
            if reads[0] >= 2:
                both_read.set()
            await both_read.wait()

        held_reads(monkeypatch, ledger, after)
        if second is not ledger:
            held_reads(monkeypatch, second, after)
        outcomes: list[str | BaseException] = []
        leave = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(enter_once, ledger, thread, outcomes, leave)
            tg.start_soon(enter_once, second, thread, outcomes, leave)
        monkeypatch.undo()
        (entered,) = [o for o in outcomes if isinstance(o, str)]
        (refused,) = [o for o in outcomes if not isinstance(o, str)]
        assert entered == expected
        assert isinstance(refused, stopline.LedgerLocked), repr(refused)
        assert f"thread {thread!r}" in str(refused) and repr(expected) in str(refused)
        assert "retry" in str(refused) and "nothing" in str(refused)
        assert (await ledger.backend.get_run(expected)).state is RunState.COMPLETED

    async with lg.run(second, owner="user:1", thread_id="lg12-at-once") as g:
        pass  # the retry, once that turn has ended: the thread's next run
    assert g.id == "lg12-at-once@turn:3"


# -- a call of an earlier run still running when the retry comes ----------------------
class Gateway:
    """A payment gateway whose charge (a ``def`` tool) is held in its worker thread until
    released, and an email provider that fails once, after the charge is at work."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()
        self.charges: list[int] = []
        self.emails: list[str] = []
        self.email_fails = True

    def tools(self) -> list[Any]:
        def charge(amount: int) -> str:
            """Charge the card."""
            self.reached.set()
            self.release.wait(BARRIER_LIMIT)
            self.charges.append(amount)
            return f"charged {amount}"

        async def send_email(to: str) -> str:
            """Send an email."""
            await anyio.to_thread.run_sync(self.reached.wait, BARRIER_LIMIT)
            if self.email_fails:
                self.email_fails = False
                raise ConnectionError("the mail server dropped the connection")
            self.emails.append(to)
            return f"sent to {to}"

        return [lc_tool(charge), lc_tool(send_email)]

    async def read_charge(self, ctx: stopline.CallContext) -> ReadBack:
        verdict = Verdict.COMMITTED if self.charges else Verdict.NOT_COMMITTED
        return ReadBack(verdict, "gateway", "read back", ended=True)

    async def read_email(self, ctx: stopline.CallContext) -> ReadBack:
        verdict = Verdict.COMMITTED if self.emails else Verdict.NOT_COMMITTED
        return ReadBack(verdict, "mail server", "read back", ended=True)


@pytest.mark.parametrize("way", ["gate", "tool"])
async def test_a_call_still_running_in_an_earlier_run_is_told_as_its_record_proves(
    ledger: stopline.Ledger, way: str
) -> None:
    """The email raised out of the graph while the charge was still at work in its
    thread: the run ended ``failed``, the charge ``requested``. The retry (the thread's
    next run) does not send the charge again: under ``sl.gate`` the model is told, in
    the receipt's words, that it was sent and has no answer yet and what settles it;
    under ``sl.tool`` the retry stops on ``OperationInDoubt`` naming it, ``requested``.
    Once its own answer is recorded, the next retry replays it: charged once. Before:
    "its outcome is in doubt until a read-back or a reviewer settles it", where neither
    settles a call still running (``verify`` does not read back a call in flight)."""
    gw = Gateway()
    charge_tool, email_tool = gw.tools()
    if way == "gate":
        hook = lg.gate(verify={"charge": gw.read_charge, "send_email": gw.read_email})
        tools = ToolNode([charge_tool, email_tool], awrap_tool_call=hook)
    else:
        charge_gated = lg.tool(charge_tool, verify=gw.read_charge)
        tools = ToolNode([charge_gated, lg.tool(email_tool, verify=gw.read_email)])
    calls = [call("charge", "c1", amount=5), call("send_email", "c2", to="a@x")]
    replies = [AIMessage("", tool_calls=calls), AIMessage("done"), AIMessage("done")]
    graph = chat_graph(tools, replies)
    thread = f"lg12-running-{way}"
    charge = f"{thread}/tool:c1"
    try:
        with pytest.raises(ConnectionError):
            async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
                await g.ainvoke(graph, {"messages": [("user", "charge and email")]})
        assert (await ledger.backend.get_operation(charge)).status is OpStatus.REQUESTED
        if way == "gate":
            async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
                state = await g.ainvoke(graph, None)
            note = str(told(state, "c1").content)
            assert told(state, "c1").status == "error"
            assert charge in note and "earlier run of this thread" in note
            assert "not sent again" in note
            assert "requested: sent; no answer yet" in note  # what its record proves
            assert "next: its provider may still complete it" in note  # what settles it
            assert "until a read-back or a reviewer settles it" not in note
        else:
            with pytest.raises(stopline.OperationInDoubt) as doubt:
                async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
                    await g.ainvoke(graph, None)
            assert doubt.value.op_id == charge and doubt.value.status is OpStatus.REQUESTED
        assert gw.charges == []  # not sent again while the first is at work
    finally:
        gw.release.set()
    while (await ledger.backend.get_operation(charge)).status is not OpStatus.COMMITTED:
        await ledger.wait_for_change(thread)  # its own answer (R4)
    if way == "tool":  # the next retry runs the step again: the charge is replayed
        async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
            state = await g.ainvoke(graph, None)
        assert g.id == f"{thread}@turn:3"
        assert told(state, "c1").content == "charged 5"
        assert all(not op.id.endswith("tool:c1") for op in await ledger.backend.operations(g.id))
    assert gw.charges == [5]


# -- a new turn repeating a call an earlier run left in doubt -------------------------
@pytest.mark.parametrize("way", ["gate", "tool"])
@pytest.mark.parametrize("fail", ["after", "before", "unread"])
async def test_a_new_turn_repeating_a_call_left_in_doubt_reads_it_back_first(
    ledger: stopline.Ledger, way: str, fail: str
) -> None:
    """Turn 1: the charge raised (``ToolNode`` made the error a message: the model was
    told it failed) and the gateway could not be read back: it is left in doubt
    (``needs_review``). Turn 2, a new message: the model asks again, under a new call
    id. That repeat is the earlier call (the same tool, the same arguments, still in
    doubt), read back first: done (``after``), it is replayed and not sent; provably not
    done (``before``), it is sent, once, in this run; still unreadable (``unread``), it
    is not sent and the model is told (``sl.tool``: ``OperationInDoubt``, which this
    ``ToolNode`` makes a message).
    Before: a new operation, sent without a read-back: charged twice (``after``)."""
    shop = Shop(fail="before" if fail == "before" else "after")
    shop.answers = False
    _, charge_fn = shop.tools()
    if way == "gate":
        hook = lg.gate(verify={"charge": shop.read_charge})
        tools = ToolNode([lc_tool(charge_fn)], awrap_tool_call=hook, handle_tool_errors=True)
    else:
        gated = lg.tool(charge_fn, verify=shop.read_charge)
        tools = ToolNode([gated], handle_tool_errors=True)
    replies = [
        AIMessage("", tool_calls=[call("charge", "c1", amount=5)]),
        AIMessage("the charge failed"),
        AIMessage("", tool_calls=[call("charge", "c9", amount=5)]),
        AIMessage("done"),
    ]
    graph = chat_graph(tools, replies)
    thread = f"lg12-repeat-{way}-{fail}"
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        await g.ainvoke(graph, {"messages": [("user", "charge 5")]})
    first = f"{thread}/tool:c1"
    while (await ledger.backend.get_operation(first)).status is not OpStatus.NEEDS_REVIEW:
        await ledger.wait_for_change(thread)  # its read-backs spent: left in doubt
    assert (await ledger.backend.get_run(thread)).state is RunState.COMPLETED
    shop.answers = fail != "unread"
    sent_before = shop.sent("charge 5")

    second = f"{thread}@turn:2"
    async with lg.run(ledger, owner="user:1", thread_id=thread) as g:
        state = await g.ainvoke(graph, {"messages": [("user", "try again")]})
    assert g.id == second
    answer = told(state, "c9")
    ops = {op.id: op.status for op in await ledger.backend.operations(second)}
    status = (await ledger.backend.get_operation(first)).status
    if fail == "after":  # it happened: replayed, not sent
        assert shop.done == ["charge 5"] and shop.sent("charge 5") == sent_before == 1
        assert "earlier run of this thread" in str(answer.content) and first in str(answer.content)
        assert ops == {} and status is OpStatus.COMMITTED
    elif fail == "before":  # it did not: sent, once, in this run, after the read-back
        assert shop.done == ["charge 5"] and shop.sent("charge 5") == sent_before + 1 == 2
        assert answer.content == "charged 5"
        assert ops == {f"{second}/tool:c9": OpStatus.COMMITTED}
        assert status is OpStatus.NOT_COMMITTED
    else:  # still in doubt: not sent; the model is told (``sl.tool``: ToolNode's message)
        assert shop.sent("charge 5") == sent_before == 1
        assert answer.status == "error" and first in str(answer.content)
        if way == "gate":
            assert "not sent again" in str(answer.content)
            assert "needs_review: outcome unknown" in str(answer.content)
        else:
            assert "OperationInDoubt" in str(answer.content)
        assert ops == {}
