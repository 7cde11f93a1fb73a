"""Probe 13 of the Pydantic AI adapter (ADR 0113): what a kept history is told of a call
in review, and the paths to the agent's tools that do not go through ``s.run``.

**What the record proves.** ``s.history`` gave every call whose status blocks a resume
(in flight, ``unknown``, in review) one return: "it may have taken effect ... report it
as awaiting confirmation". A call ``compensation_failed`` is in review too, but its
effect happened and its correction failed: the model was told its effect was in doubt.
The return now says what the ledger records, in the words of the run's receipt (its
status, and what follows).

**The other paths.** Tools a run adds (``toolsets=``, ``agent.override(toolsets=...)``,
a capability's toolset, a toolset function) pass the gate of ``s.run``; an agent with its
own ``Gate`` run by ``agent.run_sync`` in a worker thread of the block, or outside any
``sl.run`` block, is refused before anything is sent. (An agent without a gate run
directly is not seen: the guide says so.)

Real agents with Pydantic AI's ``FunctionModel``/``TestModel``, real SQLite ledgers.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from pydantic_ai import Agent, RunContext, capture_run_messages
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel
from pydantic_ai.toolsets import FunctionToolset

import stopline
from stopline import OpStatus
from stopline.domain.model import Evidence
from stopline.domain.vocab import OpEvent
from stopline.integrations import pydantic_ai as sl
from stopline.ledger.backend import OutcomeUpdate
from tests.frameworks.effects import statuses
from tests.support.own_loop import in_own_loop
from tests.truth.helpers import quiesce

pytestmark = pytest.mark.timeout(30)


def booking(ledger: stopline.Ledger, booked: list[str], go_on: anyio.Event) -> stopline.Tool[Any]:
    """A stopline tool whose correction the provider refuses once ``go_on`` is set
    (registered: ``compensate`` finds it). The adapter's tools declare no compensator, so
    the history's call is recorded under its key by this one."""

    async def book(ctx: stopline.CallContext, room: str) -> str:
        booked.append(room)
        return f"booked {room}"

    tool = stopline.Tool(book, name="book")
    tool.wants_context = True
    tool.compensation = stopline.Compensation.ALWAYS

    @tool.compensator
    async def _(ctx: stopline.CallContext) -> str:
        await go_on.wait()
        raise stopline.Rejected("the hotel refuses the cancellation")

    ledger.register_tool(tool)
    return tool


def told_of(messages: list[ModelMessage], call_id: str) -> str:
    return next(
        str(part.content)
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart) and part.tool_call_id == call_id
    )


async def told_after_a_failed_correction(
    ledger: stopline.Ledger, run_id: str, *, escalation_cut: bool
) -> tuple[OpStatus, str]:
    """``book`` (call ``b1``, no return in the history) committed, then its correction
    failed; with ``escalation_cut`` the worker stopped between the ledger's two writes
    (``compensation_failed``, then to review): the test writes the first itself while the
    correction is held. Returns the call's status and what the model is told of it."""
    booked: list[str] = []
    seen: list[list[ModelMessage]] = []
    go_on = anyio.Event()

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(messages)
        return ModelResponse(parts=[TextPart("the room stays booked")])

    agent: Agent[None, str] = Agent(FunctionModel(model))
    op_id = f"{run_id}/tool:b1"
    async with sl.run(ledger, owner="user:1", run_id=run_id) as s:
        await s.bound.run.call(booking(ledger, booked, go_on), "12", key="tool:b1")
        await ledger.compensate(op_id, by="user:1", wait=False)  # held: compensating
        if escalation_cut:
            cut = OutcomeUpdate(OpEvent.COMPENSATION_FAILED, [Evidence.local(op_id, "cut")])
            await ledger.backend.record(op_id, cut)
        go_on.set()
        await quiesce(ledger)
        status = (await statuses(ledger, run_id))["tool:b1"]
        kept: list[ModelMessage] = [
            ModelRequest(parts=[UserPromptPart("book room 12, then cancel it")]),
            ModelResponse(parts=[ToolCallPart("book", {"room": "12"}, tool_call_id="b1")]),
            ModelRequest(parts=[UserPromptPart("is it cancelled?")]),
        ]
        await s.run(agent, message_history=await s.history(kept))
    assert booked == ["12"]  # nothing sent again
    return status, told_of(seen[-1], "b1")


async def test_a_call_whose_correction_failed_is_told_it_happened(
    ledger: stopline.Ledger,
) -> None:
    """A call at rest in ``compensation_failed`` (its escalation cut): the model is told it
    was done and its correction failed (the receipt's words), not that it may have taken
    effect. Failed on the old code: "it may have taken effect, and its outcome is in
    doubt ... report it as awaiting confirmation"."""
    status, note = await told_after_a_failed_correction(ledger, "comp-1", escalation_cut=True)
    assert status is OpStatus.COMPENSATION_FAILED
    assert "compensation_failed: completed; the correction failed" in note
    assert "its correction comp-1/tool:b1~compensate: did not happen" in note
    assert "next: a reviewer decides: committed, not committed, or correct it again" in note
    assert "may have" not in note and "awaiting confirmation" not in note


async def test_a_call_in_review_after_a_failed_correction_is_told_so(
    ledger: stopline.Ledger,
) -> None:
    """The same correction failed, escalated to review as the ledger does: the model is
    told its correction did not happen and what a reviewer decides. Failed on the old
    code: "it may have taken effect", nothing of the failed correction."""
    status, note = await told_after_a_failed_correction(ledger, "comp-2", escalation_cut=False)
    assert status is OpStatus.NEEDS_REVIEW
    assert "needs_review: outcome unknown; waiting for human review" in note
    assert "its correction comp-2/tool:b1~compensate: did not happen" in note
    assert "or correct it again" in note and "may have" not in note


async def test_a_call_in_doubt_is_told_it_may_have_happened(ledger: stopline.Ledger) -> None:
    """A charge that raised out of the agent run (``unknown``, or in review once its
    read-back found nothing): its return in the retried history says it may have
    happened, in the receipt's words. The rule's other side (probe 12's case); failed on
    the old code by its words only ("it may have taken effect", one sentence for all)."""
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
                    ToolCallPart("reserve", {"order": "9"}, tool_call_id="c1"),
                    ToolCallPart("charge", {"order": "9"}, tool_call_id="c2"),
                ]
            )
        return ModelResponse(parts=[TextPart("awaiting confirmation")])

    agent = Agent(FunctionModel(model), toolsets=[FunctionToolset([charge, reserve])])
    async with sl.run(ledger, owner="user:1", run_id="doubt-3") as s:
        with capture_run_messages() as kept, pytest.raises(ConnectionError):
            await s.run(agent, "reserve and charge order 9")
        await s.run(agent, message_history=await s.history(kept))
    note = told_of(seen[-1], "c2")  # its status when the history was repaired
    assert "unknown: may have happened" in note or "needs_review: outcome unknown" in note
    assert charged == ["9"]


def refund_set(done: list[str]) -> FunctionToolset[Any]:
    toolset: FunctionToolset[Any] = FunctionToolset()

    @toolset.tool_plain
    async def refund(order: str) -> str:
        """Refund an order."""
        done.append(order)
        return f"refunded {order}"

    return toolset


@pytest.mark.parametrize("how", ["toolsets=", "override", "capability", "toolset function"])
async def test_tools_a_run_adds_pass_the_gate(ledger: stopline.Ledger, how: str) -> None:
    """A refund the agent gets only at run time is an operation of ``s.run``, however the
    run gets it. Passed on the old code too (``Gate`` wraps the run's whole toolset)."""
    done: list[str] = []
    capabilities: list[Any] = []
    if how == "capability":

        class Refunds(AbstractCapability[Any]):
            def get_toolset(self) -> Any:
                return refund_set(done)

        capabilities.append(Refunds())
    agent: Agent[None, str] = Agent(TestModel(call_tools=["refund"]), capabilities=capabilities)
    if how == "toolset function":

        @agent.toolset
        def refunds(ctx: RunContext[None]) -> FunctionToolset[Any]:
            return refund_set(done)

    run_id = f"added-{how.replace(' ', '-').rstrip('=')}"
    async with sl.run(ledger, owner="user:1", run_id=run_id) as s:
        if how == "toolsets=":
            await s.run(agent, "refund order 1", toolsets=[refund_set(done)])
        elif how == "override":
            with agent.override(toolsets=[refund_set(done)]):
                await s.run(agent, "refund order 1")
        else:
            await s.run(agent, "refund order 1")
    assert len(done) == 1
    assert list((await statuses(ledger, run_id)).values()) == [OpStatus.COMMITTED]


def gated_refund_agent(done: list[str]) -> Agent[None, str]:
    return Agent(
        TestModel(call_tools=["refund"]), toolsets=[refund_set(done)], capabilities=[sl.Gate()]
    )


async def test_run_sync_of_a_gated_agent_in_a_thread_is_refused(ledger: stopline.Ledger) -> None:
    """``agent.run_sync`` (the agent's own ``Gate``) in a worker thread of the block runs
    its own event loop: refused with ``WrongEventLoop``, nothing sent or recorded. Passed
    on the old code too."""
    done: list[str] = []
    agent = gated_refund_agent(done)
    async with sl.run(ledger, owner="user:1", run_id="sync-2"):
        with pytest.raises(stopline.WrongEventLoop):
            await anyio.to_thread.run_sync(in_own_loop, lambda: agent.run_sync("refund order 1"))
    assert done == []
    assert await statuses(ledger, "sync-2") == {}


async def test_a_gated_agent_outside_a_run_is_refused() -> None:
    """An agent with its own ``Gate`` run with no ``sl.run`` block: ``NoRun``, nothing
    sent. Passed on the old code too."""
    done: list[str] = []
    with pytest.raises(sl.NoRun):
        await gated_refund_agent(done).run("refund order 1")
    assert done == []
