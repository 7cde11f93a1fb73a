"""Probe 11 of the Agents SDK adapter, from a user's side (ADR 0108).

**A failed SDK run retried in the same stopline run.** The model raised (the API
went down) or a tool's error reached the caller (``failure_error_function=None``),
after a refund had committed. The user retries the way the SDK's users do, in the
same ``sl.run`` block (the run fails once its block ends with the error: a retry
after that is refused, ``RunEnded``): ``s.stream(agent, prompt)`` again. The new
SDK run's model asks for the refund again under a new call id; the earlier call had
been answered (to a model run that then failed), so the refund was a new operation
and was sent a second time. Now a failed SDK run reloads what the run recorded
(``Bound.load``): the retry's repeat is the recorded call (replayed, nothing sent),
a repeat of a call in doubt is answered from its doubt, and the retried model is
told what was recorded (``call_model_input_filter``), as after a resume.

**A tool a hook gives the agent at run time.** The SDK reads ``agent.tools`` after
its ``on_agent_start``/``AgentHooks.on_start`` hooks, every turn, and lets a hook
assign it (``Agent.__setattr__``). A tool added there ran outside the gate: no
record, nothing refused after a cancel. Now every turn's tools pass ``gate_agent``.

Real agents with the SDK's ``ScriptedModel``, real SQLite ledgers.
"""

from __future__ import annotations

from typing import Any

import pytest
from agents import Agent, AgentHooks, Tool, function_tool, set_tracing_disabled
from agents.exceptions import UserError
from agents.testing import ScriptedModel, assistant_message, function_call

import stopline
from stopline import OpStatus, RunState
from stopline.integrations import openai_agents as sl
from tests.frameworks.effects import statuses

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def no_trace_export() -> None:
    set_tracing_disabled(True)


class Payments:
    """A refund and a charge with their ground truth; the charge's first call makes its
    effect, then its answer is lost (it raises)."""

    def __init__(self, *, charge_raises_out: bool = False) -> None:
        self.done: list[str] = []
        self.charge_raises_out = charge_raises_out

    def tools(self) -> list[Tool]:
        async def refund(order: str) -> str:
            """Refund an order."""
            self.done.append(f"refund {order}")
            return f"refunded {order}"

        async def charge(order: str) -> str:
            """Charge an order."""
            self.done.append(f"charge {order}")
            if self.done.count(f"charge {order}") == 1:
                raise ConnectionError("the payments API hung up")
            return f"charged {order}"

        if self.charge_raises_out:  # its error reaches the caller, not the model
            return [function_tool(refund), function_tool(charge, failure_error_function=None)]
        return [function_tool(refund), function_tool(charge)]


def developer_notes(model: ScriptedModel) -> str:
    """What the last model call was told beside its input (the resume note)."""
    call = model.last_call
    assert call is not None and isinstance(call.input, list)
    return "\n".join(
        str(item.get("content"))
        for item in call.input
        if isinstance(item, dict) and item.get("role") == "developer"
    )


async def test_a_retry_after_the_model_failed_repeats_no_committed_call(
    ledger: stopline.Ledger,
) -> None:
    """The model fails after the refund committed; the retry from the prompt asks for it
    again: replayed from the ledger, once. Failed on the old code: refunded twice."""
    payments = Payments()
    model = ScriptedModel(
        [
            [function_call("refund", {"order": "1042"}, call_id="a1")],
            RuntimeError("the model API is down"),
            [function_call("refund", {"order": "1042"}, call_id="a2")],
            [assistant_message("done")],
        ]
    )
    agent = Agent(name="a", model=model, tools=payments.tools())
    async with sl.run(ledger, owner="user:1", run_id="retry-1") as s:
        with pytest.raises(RuntimeError, match="down"):
            await s.stream(agent, "refund order 1042")
        result = await s.stream(agent, "refund order 1042")  # the user's retry
    assert payments.done == ["refund 1042"]
    assert result.final_output == "done"
    assert "refund (tool:a1): committed: completed; do not repeat it" in developer_notes(model)
    assert await statuses(ledger, "retry-1") == {"tool:a1": OpStatus.COMMITTED}
    assert (await ledger.backend.get_run("retry-1")).state is RunState.COMPLETED


async def test_a_retry_after_a_tool_error_reached_the_caller_repeats_nothing(
    ledger: stopline.Ledger,
) -> None:
    """Two calls at once: the refund commits, the charge makes its effect and raises out
    of the SDK run. The retry asks for both again: the refund is replayed, the charge
    (in doubt, no read-back) is not sent and the model is told why. Failed on the old
    code: the refund was sent twice."""
    payments = Payments(charge_raises_out=True)
    both = [
        function_call("refund", {"order": "1042"}, call_id="a1"),
        function_call("charge", {"order": "7"}, call_id="b1"),
    ]
    again = [
        function_call("refund", {"order": "1042"}, call_id="a2"),
        function_call("charge", {"order": "7"}, call_id="b2"),
    ]
    model = ScriptedModel([both, again, [assistant_message("done")]])
    agent = Agent(name="a", model=model, tools=payments.tools())
    async with sl.run(ledger, owner="user:1", run_id="retry-2") as s:
        with pytest.raises(UserError, match="hung up"):
            await s.stream(agent, "refund 1042, charge 7")
        result = await s.stream(agent, "refund 1042, charge 7")
    assert payments.done == ["refund 1042", "charge 7"]  # once each
    said: dict[str, str] = {}  # what the model was handed for each call id
    for item in result.new_items:
        raw: Any = getattr(item, "raw_item", None)
        if isinstance(raw, dict) and raw.get("type") == "function_call_output":
            said[str(raw["call_id"])] = str(raw["output"])
    assert said["a2"] == "refunded 1042"
    assert "was not sent" in said["b2"] and "retry-2/tool:b1" in said["b2"]
    await ledger.wait_settled("retry-2", timeout=10)
    assert await statuses(ledger, "retry-2") == {
        "tool:a1": OpStatus.COMMITTED,
        "tool:b1": OpStatus.NEEDS_REVIEW,  # no read-back: a person decides
    }


async def test_a_tool_a_hook_adds_at_run_time_passes_the_gate(ledger: stopline.Ledger) -> None:
    """``AgentHooks.on_start`` gives the agent its refund tool; the call is an operation.
    Failed on the old code: the refund ran with nothing recorded."""
    payments = Payments()
    refund = payments.tools()[0]

    class GivesRefund(AgentHooks[Any]):
        async def on_start(self, context: Any, agent: Any) -> None:
            agent.tools = [*agent.tools, refund]  # the SDK's own way to change them

    model = ScriptedModel(
        [[function_call("refund", {"order": "1042"}, call_id="a1")], [assistant_message("ok")]]
    )
    agent = Agent(name="a", model=model, tools=[], hooks=GivesRefund())
    async with sl.run(ledger, owner="user:1", run_id="hook-1") as s:
        await s.stream(agent, "refund order 1042")
    assert payments.done == ["refund 1042"]
    assert await statuses(ledger, "hook-1") == {"tool:a1": OpStatus.COMMITTED}


async def test_a_tool_a_hook_adds_is_refused_after_the_cancel(ledger: stopline.Ledger) -> None:
    """The same tool, the run cancelled (``after_turn``: the SDK finishes the turn) before
    the model asks for it: refused at the gate (R1). Failed on the old code: the refund
    was sent after the cancel."""
    payments = Payments()
    refund = payments.tools()[0]
    sessions: list[sl.AgentSession] = []

    class CancelsThenGives(AgentHooks[Any]):
        async def on_start(self, context: Any, agent: Any) -> None:
            await sessions[0].cancel(by="user:1", mode="after_turn")  # stop, meanwhile
            agent.tools = [*agent.tools, refund]

    model = ScriptedModel(
        [[function_call("refund", {"order": "1042"}, call_id="a1")], [assistant_message("ok")]]
    )
    agent = Agent(name="a", model=model, tools=[], hooks=CancelsThenGives())
    async with sl.run(ledger, owner="user:1", run_id="hook-2") as s:
        sessions.append(s)
        await s.stream(agent, "refund order 1042")
    assert payments.done == []
    assert await statuses(ledger, "hook-2") == {"tool:a1": OpStatus.PREVENTED}
    assert (await ledger.backend.get_run("hook-2")).state is RunState.CANCELLED
