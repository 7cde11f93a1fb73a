"""Probe 13 of the Agents SDK adapter (ADR 0113): handoffs given after the turn's tools
were read, and the entry points that do not go through ``s.stream``.

**A handoff given after the tools were read.** ADR 0108 gated a handoff a hook gives
at the turn's read of its tools (``get_all_tools``). The SDK reads ``agent.handoffs``
later (``get_handoffs``, after the agent's dynamic ``instructions``), and before the
tools when it resumes an interrupted turn: a handoff given in between led to an
ungated agent (no record, nothing refused after a cancel). The gated copy's
``handoffs`` now gates whatever it holds whenever it is read. A handoff an
``on_llm_end`` hook gives is not the model's to call in that turn: the SDK refuses the
call (``ModelBehaviorError``: not found, nothing runs); the next turn's call of it
leads to a gated agent.

**A gated agent run without a gate to pass.** ``sl.gate_agent(agent)`` run by
``Runner.run`` outside any ``sl.run`` block (``NoRun``), or by ``Runner.run_sync`` in a
worker thread, whose event loop is not the ledger's (``WrongEventLoop``): stopline
refused the call (nothing sent), and the SDK told the model "An error occurred while
running the tool. Please try again." and the run went on to complete. These now fail
the SDK run (``UserError`` from stopline's error).

Real agents with the SDK's ``ScriptedModel``, real SQLite ledgers.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from agents import (
    Agent,
    AgentHooks,
    Runner,
    Tool,
    function_tool,
    handoff,
    set_tracing_disabled,
)
from agents.exceptions import ModelBehaviorError, UserError
from agents.testing import ScriptedModel, assistant_message, function_call

import stopline
from stopline import OpStatus, RunState
from stopline.integrations import openai_agents as sl
from tests.frameworks.effects import statuses
from tests.support.own_loop import in_own_loop
from tests.truth.helpers import quiesce

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def no_trace_export() -> None:
    set_tracing_disabled(True)


def refund_tool(done: list[str]) -> Tool:
    async def refund(order: str) -> str:
        """Refund an order."""
        done.append(f"refund {order}")
        return f"refunded {order}"

    return function_tool(refund)


def handoff_then_refund(*, first: list[Any] | None = None) -> ScriptedModel:
    """One model for both agents: (``first``, then) hand off to ``b``, ``b`` refunds, then
    answers."""
    turns: list[Any] = [*(first or [])]
    return ScriptedModel(
        [
            *turns,
            [function_call("transfer_to_b", {}, call_id="h1")],
            [function_call("refund", {"order": "1042"}, call_id="a1")],
            [assistant_message("refunded")],
        ]
    )


@pytest.mark.parametrize("as_handoff", [False, True], ids=["agent", "Handoff"])
async def test_a_handoff_dynamic_instructions_give_is_gated(
    ledger: stopline.Ledger, as_handoff: bool
) -> None:
    """The agent's ``instructions`` function gives it a handoff to ``b`` (an ``Agent`` or a
    ``Handoff``): the SDK reads it after the turn's tools, in the same turn; ``b``'s refund
    is an operation. Failed on the old code: the refund ran with nothing recorded."""
    done: list[str] = []
    model = handoff_then_refund()
    b = Agent(name="b", model=model, tools=[refund_tool(done)])

    def instructions(context: Any, agent: Agent[Any]) -> str:
        if not agent.handoffs:
            agent.handoffs = [handoff(b) if as_handoff else b]
        return "Refund what the user asks for."

    agent = Agent(name="a", model=model, instructions=instructions)
    async with sl.run(ledger, owner="user:1", run_id="late-1") as s:
        result = await s.stream(agent, "refund order 1042")
    assert result.final_output == "refunded"
    assert result.last_agent.name == "b"
    assert done == ["refund 1042"]
    assert await statuses(ledger, "late-1") == {"tool:a1": OpStatus.COMMITTED}
    assert agent.handoffs == []  # the gated copy's, not the user's


async def test_a_handoff_instructions_give_is_refused_after_the_cancel(
    ledger: stopline.Ledger,
) -> None:
    """The same, cancelled (``after_turn``) before ``b`` asks for the refund: refused at the
    gate (R1). Failed on the old code: the refund was sent after the cancel."""
    done: list[str] = []
    model = handoff_then_refund()
    sessions: list[sl.AgentSession] = []

    class CancelsAtStart(AgentHooks[Any]):
        async def on_start(self, context: Any, agent: Any) -> None:
            await sessions[0].cancel(by="user:1", mode="after_turn")

    b = Agent(name="b", model=model, tools=[refund_tool(done)], hooks=CancelsAtStart())

    def instructions(context: Any, agent: Agent[Any]) -> str:
        if not agent.handoffs:
            agent.handoffs = [b]
        return "Refund what the user asks for."

    agent = Agent(name="a", model=model, instructions=instructions)
    async with sl.run(ledger, owner="user:1", run_id="late-2") as s:
        sessions.append(s)
        await s.stream(agent, "refund order 1042")
    assert done == []
    assert await statuses(ledger, "late-2") == {"tool:a1": OpStatus.PREVENTED}
    assert (await ledger.backend.get_run("late-2")).state is RunState.CANCELLED


async def test_a_handoff_on_llm_end_gives_is_refused_by_the_sdk_in_that_turn(
    ledger: stopline.Ledger,
) -> None:
    """``on_llm_end`` gives the handoff after the SDK read the turn's handoffs, and the
    model's response of that turn calls it: the SDK refuses the call (not found), nothing
    runs, nothing is recorded, the run fails. Passed on the old code too (the SDK's own
    refusal): the edge as this SDK version has it."""
    done: list[str] = []
    model = handoff_then_refund()
    b = Agent(name="b", model=model, tools=[refund_tool(done)])

    class GivesLate(AgentHooks[Any]):
        async def on_llm_end(self, context: Any, agent: Any, response: Any) -> None:
            if not agent.handoffs:
                agent.handoffs = [b]

    agent = Agent(name="a", model=model, hooks=GivesLate())
    async with sl.run(ledger, owner="user:1", run_id="late-3") as s:
        with pytest.raises(ModelBehaviorError, match="transfer_to_b not found"):
            await s.stream(agent, "refund order 1042")
    assert done == []
    assert await statuses(ledger, "late-3") == {}


async def test_a_handoff_on_llm_end_gives_is_gated_in_the_next_turn(
    ledger: stopline.Ledger,
) -> None:
    """``on_llm_end`` gives the handoff in a turn whose response asks for a lookup; the
    next turn calls it: ``b``'s refund is an operation (the lookup is a read). Passed on
    the old code too (its next turn's ``get_all_tools`` gated it)."""
    done: list[str] = []

    async def lookup(order: str) -> str:
        """Look an order up."""
        return f"order {order}: paid"

    model = handoff_then_refund(first=[[function_call("lookup", {"order": "1042"}, call_id="l1")]])
    b = Agent(name="b", model=model, tools=[refund_tool(done)])

    class GivesLate(AgentHooks[Any]):
        async def on_llm_end(self, context: Any, agent: Any, response: Any) -> None:
            if not agent.handoffs:
                agent.handoffs = [b]

    agent = Agent(name="a", model=model, hooks=GivesLate(), tools=[function_tool(lookup)])
    async with sl.run(ledger, owner="user:1", run_id="late-4", reads={"lookup"}) as s:
        result = await s.stream(agent, "refund order 1042")
    assert result.last_agent.name == "b"
    assert done == ["refund 1042"]
    assert await statuses(ledger, "late-4") == {"tool:a1": OpStatus.COMMITTED}


def one_refund(done: list[str]) -> Agent[Any]:
    model = ScriptedModel(
        [[function_call("refund", {"order": "7"}, call_id="r1")], [assistant_message("done")]]
    )
    return Agent(name="a", model=model, tools=[refund_tool(done)])


async def test_a_gated_agent_run_outside_a_run_fails_the_sdk_run() -> None:
    """``Runner.run`` of ``sl.gate_agent(agent)`` with no ``sl.run`` block: the SDK run fails
    with stopline's ``NoRun``, nothing sent. Failed on the old code: the model was told
    "An error occurred while running the tool. Please try again." and the run completed."""
    done: list[str] = []
    with pytest.raises(UserError) as raised:
        await Runner.run(sl.gate_agent(one_refund(done)), "refund order 7")
    assert isinstance(raised.value.__cause__, sl.NoRun)
    assert done == []


async def test_runner_run_sync_in_a_thread_fails_the_sdk_run(ledger: stopline.Ledger) -> None:
    """``Runner.run_sync`` of a gated agent in a worker thread inside the block (its own
    event loop, not the ledger's): the SDK run fails with ``WrongEventLoop``, nothing sent
    or recorded. Failed on the old code: the SDK run completed, the refusal told to the
    model as a tool error to retry."""
    done: list[str] = []
    gated = sl.gate_agent(one_refund(done))
    async with sl.run(ledger, owner="user:1", run_id="sync-1"):
        with pytest.raises(UserError) as raised:
            await anyio.to_thread.run_sync(
                in_own_loop, lambda: Runner.run_sync(gated, "refund order 7")
            )
    assert isinstance(raised.value.__cause__, stopline.WrongEventLoop)
    assert done == []
    assert await statuses(ledger, "sync-1") == {}


async def test_runner_run_of_a_gated_agent_in_the_block_is_gated(ledger: stopline.Ledger) -> None:
    """``Runner.run`` of ``sl.gate_agent(agent)`` in the block: its calls pass the gate of
    the bound run (the docs' advice for an agent run outside ``s.stream``). Passed on the
    old code too."""
    done: list[str] = []
    async with sl.run(ledger, owner="user:1", run_id="direct-1"):
        result = await Runner.run(sl.gate_agent(one_refund(done)), "refund order 7")
    assert result.final_output == "done"
    assert done == ["refund 7"]
    assert await statuses(ledger, "direct-1") == {"tool:r1": OpStatus.COMMITTED}


async def test_a_resumed_model_is_told_a_correction_failed(ledger: stopline.Ledger) -> None:
    """A call the run recorded, whose correction then failed (in review); an SDK run of the
    block fails and is retried (ADR 0108): the retried model's note says so in the
    receipt's words. Failed on the old code: "in doubt; do not
    repeat it, it is under review", and the failed correction as a call of its own: "book
    (tool:b1~compensate): not_committed: did not happen; it may be called again"."""
    go_on = anyio.Event()

    async def book(ctx: stopline.CallContext, room: str) -> str:
        return f"booked {room}"

    tool = stopline.Tool(book, name="book")
    tool.wants_context = True
    tool.compensation = stopline.Compensation.ALWAYS

    @tool.compensator
    async def _(ctx: stopline.CallContext) -> str:
        await go_on.wait()
        raise stopline.Rejected("the hotel refuses the cancellation")

    ledger.register_tool(tool)
    again = ScriptedModel([[assistant_message("the room stays booked")]])
    async with sl.run(ledger, owner="user:1", run_id="oa-comp") as s:
        await s.bound.run.call(tool, "12", key="tool:b1")
        await ledger.compensate("oa-comp/tool:b1", by="user:1", wait=False)
        go_on.set()
        await quiesce(ledger)
        failing = ScriptedModel([ConnectionError("the model's API hung up")])
        with pytest.raises(ConnectionError):  # the SDK run fails: retried as a new entry
            await s.stream(Agent(name="a", model=failing), "is it cancelled?")
        await s.stream(Agent(name="a", model=again), "is it cancelled?")
    (note,) = [
        item["content"]
        for item in again.calls[0].input
        if isinstance(item, dict) and item.get("role") == "developer"
    ]
    assert "book (tool:b1): needs_review: outcome unknown; waiting for human review" in note
    assert "its correction oa-comp/tool:b1~compensate: did not happen" in note
    assert "or correct it again; do not repeat it" in note
    # the correction is told with its call, never as a call "that may be called again"
    assert "(tool:b1~compensate):" not in note and "may be called again" not in note
