"""Probe 12 of the Pydantic AI adapter (ADR 0108, addendum).

**The agent's other entry points.** ``s.run`` and ``s.iter`` add the ``Gate`` to the
agent run; ``agent.run_stream`` and ``agent.run_stream_events`` had no ``s.``
counterpart, and called in the ``sl.run`` block on an agent without
``capabilities=[sl.Gate()]`` their tools ran outside the gate, silently (no record,
nothing refused after a cancel). Pydantic AI offers no hook over an agent run it
does not start through us, so the bypass cannot be refused; ``s.run_stream`` and
``s.run_stream_events`` now run them on the same path as ``s.run``.

**A call in doubt in a kept history.** A tool raised out of the agent run (recorded
``unknown``), or a cancel cut it. Pydantic AI's history (``capture_run_messages``,
``RunCancelled.all_messages()``) ends with the interrupted request holding the other
calls' returns; on the next run Pydantic AI answers the cut call itself, "The tool
call was interrupted before a result was produced.", which reads as "it did not
happen": the model asks for it again. ``s.history`` now gives it a return saying it
may have happened (a call of a response that ends the history is left open: Pydantic
AI runs it again and the gate answers it).

Real agents with Pydantic AI's ``FunctionModel``/``TestModel``, real SQLite ledgers.
"""

from __future__ import annotations

import pytest
from pydantic_ai import Agent, capture_run_messages
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel
from pydantic_ai.toolsets import FunctionToolset

import stopline
from stopline import OpStatus, RunState
from stopline.integrations import pydantic_ai as sl
from tests.frameworks.effects import statuses

pytestmark = pytest.mark.timeout(30)


def refund_agent(done: list[str], *, own_gate: bool = False) -> Agent[None, str]:
    """An agent (without its own ``Gate`` unless ``own_gate``); ``TestModel`` calls the
    refund once."""
    capabilities = [sl.Gate()] if own_gate else []
    agent: Agent[None, str] = Agent(TestModel(call_tools=["refund"]), capabilities=capabilities)

    @agent.tool_plain
    async def refund(order: str) -> str:
        """Refund an order."""
        done.append(order)
        return f"refunded {order}"

    return agent


async def test_s_run_stream_gates_the_agents_tools(ledger: stopline.Ledger) -> None:
    """``s.run_stream``: the refund is an operation, the run completes. Failed on the old
    code: there was no ``s.run_stream`` (``agent.run_stream`` left the refund ungated)."""
    done: list[str] = []
    agent = refund_agent(done)
    async with (
        sl.run(ledger, owner="user:1", run_id="stream-1") as s,
        s.run_stream(agent, "refund order 1042") as streamed,
    ):
        output = await streamed.get_output()
    assert output and len(done) == 1
    assert list((await statuses(ledger, "stream-1")).values()) == [OpStatus.COMMITTED]
    assert (await ledger.backend.get_run("stream-1")).state is RunState.COMPLETED


async def test_an_agent_with_its_own_gate_is_gated_on_agent_run_stream(
    ledger: stopline.Ledger,
) -> None:
    """What the docs advise for a direct ``agent.run_stream`` in the block: the agent's
    own ``Gate``. Passed on the old code too (the advice's proof)."""
    done: list[str] = []
    agent = refund_agent(done, own_gate=True)
    async with (
        sl.run(ledger, owner="user:1", run_id="stream-4"),
        agent.run_stream("refund order 1042") as streamed,
    ):
        await streamed.get_output()
    assert len(done) == 1
    assert list((await statuses(ledger, "stream-4")).values()) == [OpStatus.COMMITTED]


async def test_s_run_stream_events_after_a_cancel_sends_nothing(ledger: stopline.Ledger) -> None:
    """``s.run_stream_events`` in a run cancelled before it: no model call, no refund,
    the block ends quietly with the run cancelled. Failed on the old code: there was no
    ``s.run_stream_events``."""
    done: list[str] = []
    agent = refund_agent(done)
    async with sl.run(ledger, owner="user:1", run_id="stream-2") as s:
        await s.cancel(by="user:1")
        async with s.run_stream_events(agent, "refund order 1042") as events:
            async for _ in events:
                pass
    assert done == []
    assert (await ledger.backend.get_run("stream-2")).state is RunState.CANCELLED


async def test_s_run_stream_events_gates_the_agents_tools(ledger: stopline.Ledger) -> None:
    """The events to their end: the refund is an operation. Failed on the old code: no
    ``s.run_stream_events``."""
    done: list[str] = []
    agent = refund_agent(done)
    async with sl.run(ledger, owner="user:1", run_id="stream-3") as s:
        async with s.run_stream_events(agent, "refund order 1042") as events:
            async for _ in events:
                pass
        assert events.result is not None
    assert len(done) == 1
    assert list((await statuses(ledger, "stream-3")).values()) == [OpStatus.COMMITTED]


async def test_a_call_in_doubt_in_a_retried_history_is_not_called_interrupted(
    ledger: stopline.Ledger,
) -> None:
    """Reserve and charge at once; the charge raises out of the agent run (``unknown``).
    The user retries in the same block with the captured messages through ``s.history``:
    the charge's return says it may have happened, where Pydantic AI would say it was
    interrupted, and nothing is sent again. Failed on the old code: the model read "The
    tool call was interrupted before a result was produced."."""
    charged: list[str] = []
    seen: list[list[ModelMessage]] = []

    async def charge(order: str) -> str:
        """Charge an order."""
        charged.append(order)
        raise ConnectionError("the payments API hung up")

    async def reserve(order: str) -> str:
        """Reserve stock."""
        return f"reserved {order}"

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(messages)
        if len(seen) == 1:
            return ModelResponse(
                parts=[
                    ToolCallPart("reserve", {"order": "1042"}, tool_call_id="c1"),
                    ToolCallPart("charge", {"order": "1042"}, tool_call_id="c2"),
                ]
            )
        return ModelResponse(parts=[TextPart("awaiting confirmation")])

    agent = Agent(FunctionModel(model), toolsets=[FunctionToolset([charge, reserve])])
    async with sl.run(ledger, owner="user:1", run_id="doubt-1") as s:
        with capture_run_messages() as kept, pytest.raises(ConnectionError):
            await s.run(agent, "reserve and charge order 1042")
        assert isinstance(kept[-1], ModelRequest)  # the interrupted request: c1's return
        result = await s.run(agent, message_history=await s.history(kept))
    assert result.output == "awaiting confirmation"
    assert charged == ["1042"]
    told = {
        part.tool_call_id: str(part.content)
        for message in seen[-1]
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart)
    }
    assert told["c1"] == "reserved 1042"
    assert "interrupted before a result" not in told["c2"]
    assert "may have happened" in told["c2"] or "outcome unknown" in told["c2"]
    assert "doubt-1/tool:c2" in told["c2"]
    assert (await statuses(ledger, "doubt-1"))["tool:c2"] in (
        OpStatus.UNKNOWN,
        OpStatus.NEEDS_REVIEW,
    )


async def test_a_call_in_doubt_in_the_last_response_is_left_to_the_gate(
    ledger: stopline.Ledger,
) -> None:
    """The history ends with the response asking for the charge in doubt: ``s.history``
    adds nothing, Pydantic AI runs it again under its own id and the gate answers it
    from its doubt (nothing sent). Passed on the old code too: the rule's other side."""
    charged: list[str] = []

    async def charge(order: str) -> str:
        """Charge an order."""
        charged.append(order)
        raise ConnectionError("the payments API hung up")

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not any(isinstance(p, ToolReturnPart) for m in messages for p in m.parts):
            return ModelResponse(parts=[ToolCallPart("charge", {"order": "7"}, tool_call_id="c1")])
        return ModelResponse(parts=[TextPart("awaiting confirmation")])

    agent = Agent(FunctionModel(model), toolsets=[FunctionToolset([charge])])
    async with sl.run(ledger, owner="user:1", run_id="doubt-2") as s:
        with capture_run_messages() as kept, pytest.raises(ConnectionError):
            await s.run(agent, "charge order 7")
        cut = [m for m in kept if not (isinstance(m, ModelRequest) and m.state == "interrupted")]
        assert isinstance(cut[-1], ModelResponse)
        history = await s.history(cut)
        assert history == cut  # left open: no return added
        result = await s.run(agent, message_history=history)
    assert result.output == "awaiting confirmation"
    assert charged == ["7"]
