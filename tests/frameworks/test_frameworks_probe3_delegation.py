"""Pydantic AI agent delegation: a tool that runs another agent (ADR 0068).

Pydantic AI has no hook over an agent run that a tool starts: the child's tools
pass the gate when that run is given the gate (``capabilities=[sl.Gate()]``), and
then they are operations of the same stopline run: recorded, fenced by its cancel,
read in its receipt. The delegating tool, which does nothing but run the child,
is named in ``reads`` (no operation of its own), as the Agents SDK's agent tools
are. Real agents with ``FunctionModel``; barriers, no sleeps.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from pydantic_ai import Agent, RunContext, Tool
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
from stopline import Headline, OpStatus, RunState
from stopline.integrations import pydantic_ai as pai
from tests.frameworks.effects import FileEffect

pytestmark = pytest.mark.timeout(30)


class Once:
    """Asks for one call (after ``thinking``, when set), then answers with its return."""

    def __init__(self, call: ToolCallPart) -> None:
        self.call = call
        self.asked = anyio.Event()
        self.thinking: anyio.Event | None = None

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        for message in messages:
            for part in message.parts if isinstance(message, ModelRequest) else ():
                if isinstance(part, ToolReturnPart):
                    return ModelResponse(parts=[TextPart(f"done: {part.content}")])
        self.asked.set()
        if self.thinking is not None:
            await self.thinking.wait()
        return ModelResponse(parts=[self.call])


def delegation(effect: FileEffect) -> tuple[Agent[None, str], Once]:
    """A parent whose ``delegate`` tool runs a child agent, the child run given the gate."""
    child_model = Once(ToolCallPart("write_note", {"note": "refund 9"}, tool_call_id="k1"))
    child = Agent(FunctionModel(child_model))

    @child.tool_plain
    async def write_note(note: str) -> str:
        """Write a note."""
        return await effect.awrite(note)

    async def delegate(ctx: RunContext[None], task: str) -> str:
        """Hand the task to the notes agent."""
        done = await child.run(task, usage=ctx.usage, capabilities=[pai.Gate()])
        return done.output

    parent_model = FunctionModel(Once(ToolCallPart("delegate", {"task": "refund 9"}, "p1")))
    return Agent(parent_model, tools=[Tool(delegate)]), child_model


async def test_a_child_agent_run_given_the_gate_is_gated_in_the_same_run(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    effect = FileEffect(tmp_path / "notes.txt")
    parent, _ = delegation(effect)
    async with pai.run(ledger, owner="user:1", run_id="pai-dg-ok", reads={"delegate"}) as s:
        result = await s.run(parent, "refund 9")
    assert result.output == "done: done: wrote refund 9"
    receipt = await ledger.receipt("pai-dg-ok")
    assert [(line.op_id, line.status) for line in receipt.lines] == [
        ("pai-dg-ok/tool:k1", OpStatus.COMMITTED)
    ]
    assert effect.lines() == ["refund 9"]


async def test_a_cancel_fences_the_child_agents_calls(
    unwatched: stopline.Ledger, ledger_url: str, tmp_path: Path
) -> None:
    """A cancel committed while the child's model thinks (by another worker: the gate is
    where this one learns of it): the child's call is refused at the gate, nothing is
    written, and the receipt says so."""
    effect = FileEffect(tmp_path / "notes.txt")
    parent, child_model = delegation(effect)
    child_model.thinking = anyio.Event()

    async def agent_run() -> None:
        async with pai.run(unwatched, owner="user:1", run_id="pai-dg-cut", reads={"delegate"}) as s:
            await s.run(parent, "refund 9")

    async with anyio.create_task_group() as tg:
        tg.start_soon(agent_run)
        await child_model.asked.wait()
        async with stopline.open(ledger_url) as elsewhere:
            await elsewhere.cancel("pai-dg-cut", by="user:1")
        child_model.thinking.set()
    receipt = await unwatched.wait_settled("pai-dg-cut", timeout=10)
    assert effect.lines() == []
    assert receipt.run_state is RunState.CANCELLED
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert [(line.op_id, line.status) for line in receipt.lines] == [
        ("pai-dg-cut/tool:k1", OpStatus.PREVENTED)
    ]
