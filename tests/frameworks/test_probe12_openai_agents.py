"""Probe 12 of the Agents SDK adapter: a handoff a hook adds at run time (ADR 0108).

The SDK reads ``agent.handoffs`` every turn (``run_internal.turn_preparation.
get_handoffs``, a function of its own, not a method an agent can override), after
its ``RunHooks.on_agent_start``/``AgentHooks.on_start`` hooks, and a hook may assign
it. ``gate_agent`` copied the agents the handoffs led to once, when the run started:
an agent a hook gave as a handoff ran as it was, its tools outside the gate (no
record, nothing refused after a cancel). Now the gated copy's ``get_all_tools`` (the
SDK's read of a turn's tools, right after the hooks and before it reads the
handoffs) gates what the handoffs gained as well.

Real agents with the SDK's ``ScriptedModel``, real SQLite ledgers.
"""

from __future__ import annotations

from typing import Any

import pytest
from agents import (
    Agent,
    AgentHooks,
    RunHooks,
    Tool,
    function_tool,
    handoff,
    set_tracing_disabled,
)
from agents.testing import ScriptedModel, assistant_message, function_call

import stopline
from stopline import OpStatus, RunState
from stopline.integrations import openai_agents as sl
from tests.frameworks.effects import statuses

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


def handoff_then_refund() -> ScriptedModel:
    """One model for both agents: hand off to ``b``, then ``b`` refunds, then answers."""
    return ScriptedModel(
        [
            [function_call("transfer_to_b", {}, call_id="h1")],
            [function_call("refund", {"order": "1042"}, call_id="a1")],
            [assistant_message("refunded")],
        ]
    )


async def test_a_handoff_an_agent_hook_adds_leads_to_a_gated_agent(
    ledger: stopline.Ledger,
) -> None:
    """``AgentHooks.on_start`` gives agent ``a`` a handoff to ``b``, whose refund is then
    an operation. Failed on the old code: the refund ran with nothing recorded."""
    done: list[str] = []
    model = handoff_then_refund()
    b = Agent(name="b", model=model, tools=[refund_tool(done)])

    class GivesHandoff(AgentHooks[Any]):
        async def on_start(self, context: Any, agent: Any) -> None:
            agent.handoffs = [*agent.handoffs, b]

    agent = Agent(name="a", model=model, hooks=GivesHandoff())
    async with sl.run(ledger, owner="user:1", run_id="handoff-1") as s:
        result = await s.stream(agent, "refund order 1042")
    assert result.final_output == "refunded"
    assert result.last_agent.name == "b"
    assert done == ["refund 1042"]
    assert await statuses(ledger, "handoff-1") == {"tool:a1": OpStatus.COMMITTED}


async def test_a_handoff_a_run_hook_adds_is_refused_after_the_cancel(
    ledger: stopline.Ledger,
) -> None:
    """``RunHooks.on_agent_start`` gives ``a`` a ``Handoff`` to ``b``, and cancels the run
    when ``b`` starts (``after_turn``: the SDK finishes ``b``'s turn): the refund ``b``
    asks for is refused at the gate (R1). Failed on the old code: the refund was sent
    after the cancel."""
    done: list[str] = []
    model = handoff_then_refund()
    b = Agent(name="b", model=model, tools=[refund_tool(done)])
    sessions: list[sl.AgentSession] = []

    class CancelsThenGives(RunHooks[Any]):
        async def on_agent_start(self, context: Any, agent: Any) -> None:
            if agent.name == "a":
                agent.handoffs = [*agent.handoffs, handoff(b)]
            else:  # stop, meanwhile
                await sessions[0].cancel(by="user:1", mode="after_turn")

    agent = Agent(name="a", model=model)
    async with sl.run(ledger, owner="user:1", run_id="handoff-2") as s:
        sessions.append(s)
        await s.stream(agent, "refund order 1042", hooks=CancelsThenGives())
    assert done == []
    assert await statuses(ledger, "handoff-2") == {"tool:a1": OpStatus.PREVENTED}
    assert (await ledger.backend.get_run("handoff-2")).state is RunState.CANCELLED


async def test_a_handoff_appended_in_place_is_gated_and_the_original_is_untouched(
    ledger: stopline.Ledger,
) -> None:
    """A hook appending to the copy's list (``agent.handoffs.append``) is seen too, and
    the user's agent keeps its own handoffs. Failed on the old code: ungated."""
    done: list[str] = []
    model = handoff_then_refund()
    b = Agent(name="b", model=model, tools=[refund_tool(done)])

    class Appends(AgentHooks[Any]):
        given = False

        async def on_start(self, context: Any, agent: Any) -> None:
            if not self.given:
                self.given = True
                agent.handoffs.append(b)

    agent = Agent(name="a", model=model, hooks=Appends())
    async with sl.run(ledger, owner="user:1", run_id="handoff-3") as s:
        await s.stream(agent, "refund order 1042")
    assert done == ["refund 1042"]
    assert agent.handoffs == []  # the gated copy's list, not the user's
    assert await statuses(ledger, "handoff-3") == {"tool:a1": OpStatus.COMMITTED}
