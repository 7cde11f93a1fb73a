"""Probe 11 of the Pydantic AI adapter, from a user's side (ADR 0108).

**A repeat of a call in doubt raised out of the agent run.** A call that raised is
recorded ``unknown`` (its effect may have happened), and so is one that raised
``ModelRetry`` (a retry alone proves nothing). The model asks for it again, same
arguments: the gate matches the repeat to the call in doubt (``_open_calls``, ADR
0097) and refuses to send it, ``OperationInDoubt``. The Agents SDK and LangGraph
adapters tell the model so (``in_doubt_note``); Pydantic AI's raised it out of
``agent.run``: the whole agent run failed (its other answers lost, the stopline run
``failed``) on the very path ADR 0097 made safe. Now the model is told, as elsewhere.

**A failed agent run retried in the same stopline run.** The model raised after a
refund committed; the user retries in the same ``sl.run`` block (after it the run has
failed: a retry is refused, ``RunEnded``), ``s.run(agent, prompt)`` again. The new
agent run's model asked for the refund under a new call id, and it was sent a second
time. Now a failed agent run reloads what the run recorded (``Bound.load``): the
repeat is the recorded call, replayed.

Real agents with Pydantic AI's ``FunctionModel``, real SQLite ledgers.
"""

from __future__ import annotations

import pytest
from pydantic_ai import Agent, ModelRetry, capture_run_messages
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

import stopline
from stopline import OpStatus, RunState
from stopline.integrations import pydantic_ai as sl
from tests.frameworks.effects import statuses

pytestmark = pytest.mark.timeout(30)


def returns(messages: list[ModelMessage]) -> dict[str, str]:
    """What the model was handed for each tool call id."""
    return {
        part.tool_call_id: str(part.content)
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart)
    }


class Script:
    """A model that asks for the calls of ``turns`` in order, then says ``done``; a turn
    that is an exception is raised (the model API failing)."""

    def __init__(self, *turns: list[ToolCallPart] | Exception) -> None:
        self.turns = list(turns)
        self.seen: list[ModelMessage] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.seen = messages
        if not self.turns:
            return ModelResponse(parts=[TextPart("done")])
        turn = self.turns.pop(0)
        if isinstance(turn, Exception):
            raise turn
        return ModelResponse(parts=list(turn))


def call(tool: str, order: str, call_id: str) -> ToolCallPart:
    return ToolCallPart(tool, {"order": order}, tool_call_id=call_id)


async def test_a_repeat_of_a_call_that_raised_is_told_to_the_model(
    ledger: stopline.Ledger,
) -> None:
    """Two calls at once: the refund commits, the charge makes its effect and raises out
    of the agent run. The user retries with the run's messages; the model asks for the
    charge again: not sent, the model is told why, the run completes. Failed on the old
    code: ``OperationInDoubt`` raised out of the retried agent run."""
    done: list[str] = []
    script = Script(
        [call("refund", "1042", "a1"), call("charge", "7", "b1")],
        [call("charge", "7", "b2")],
    )
    agent: Agent[None, str] = Agent(FunctionModel(script))

    @agent.tool_plain
    async def refund(order: str) -> str:
        done.append(f"refund {order}")
        return f"refunded {order}"

    @agent.tool_plain
    async def charge(order: str) -> str:
        done.append(f"charge {order}")
        if done.count(f"charge {order}") == 1:
            raise ConnectionError("the payments API hung up")
        return f"charged {order}"

    async with sl.run(ledger, owner="user:1", run_id="doubt-pai-1") as s:
        with capture_run_messages() as messages, pytest.raises(ConnectionError):
            await s.run(agent, "refund 1042, charge 7")
        result = await s.run(agent, message_history=messages)
    assert result.output == "done"
    assert done == ["refund 1042", "charge 7"]  # once each
    said = returns(result.all_messages())
    assert said["a1"] == "refunded 1042"
    assert "was not sent" in said["b2"] and "doubt-pai-1/tool:b1" in said["b2"]
    assert await statuses(ledger, "doubt-pai-1") == {
        "tool:a1": OpStatus.COMMITTED,
        "tool:b1": OpStatus.NEEDS_REVIEW,  # no read-back: a person decides
    }
    assert (await ledger.backend.get_run("doubt-pai-1")).state is RunState.COMPLETED


async def test_a_model_retry_asked_again_with_the_same_arguments_is_told_to_the_model(
    ledger: stopline.Ledger,
) -> None:
    """A tool sends the refund, then raises ``ModelRetry`` (its answer looked wrong). The
    model asks again, same order: in doubt, not sent, told so; the agent run ends.
    Failed on the old code: ``OperationInDoubt`` ended the agent run and the run failed."""
    done: list[str] = []
    script = Script([call("refund", "1042", "a1")], [call("refund", "1042", "a2")])
    agent: Agent[None, str] = Agent(FunctionModel(script))

    @agent.tool_plain(retries=3)
    async def refund(order: str) -> str:
        done.append(f"refund {order}")
        raise ModelRetry("the payments API answered something unreadable; try again")

    async with sl.run(ledger, owner="user:1", run_id="doubt-pai-2") as s:
        result = await s.run(agent, "refund 1042")
    assert result.output == "done"
    assert done == ["refund 1042"]
    assert "was not sent" in returns(result.all_messages())["a2"]
    assert await statuses(ledger, "doubt-pai-2") == {"tool:a1": OpStatus.NEEDS_REVIEW}


async def test_a_retry_after_the_model_failed_repeats_no_committed_call(
    ledger: stopline.Ledger,
) -> None:
    """The model fails after the refund committed; the user's retry from the prompt asks
    for it again under a new id: replayed from the ledger, once. Failed on the old code:
    refunded twice."""
    done: list[str] = []
    script = Script(
        [call("refund", "1042", "a1")],
        RuntimeError("the model API is down"),
        [call("refund", "1042", "a2")],
    )
    agent: Agent[None, str] = Agent(FunctionModel(script))

    @agent.tool_plain
    async def refund(order: str) -> str:
        done.append(f"refund {order}")
        return f"refunded {order}"

    async with sl.run(ledger, owner="user:1", run_id="retry-pai-1") as s:
        with pytest.raises(RuntimeError, match="down"):
            await s.run(agent, "refund order 1042")
        result = await s.run(agent, "refund order 1042")  # the user's retry
    assert done == ["refund 1042"]
    assert returns(result.all_messages())["a2"] == "refunded 1042"
    assert await statuses(ledger, "retry-pai-1") == {"tool:a1": OpStatus.COMMITTED}
    assert (await ledger.backend.get_run("retry-pai-1")).state is RunState.COMPLETED
