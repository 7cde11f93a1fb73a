"""Pydantic AI output functions pass the gate, as tools do.

An output function (``output_type=[send_refund]``) runs as Pydantic AI's output
processing, not through a toolset: the ``Gate`` never saw it, and its effect ran
with nothing recorded (the refund sent, the receipt empty). Now each call of one is
an operation keyed by its tool call: recorded, replayed on resume (not sent again),
in doubt when cut, never "not committed" while it may have acted. The model is
Pydantic AI's own ``FunctionModel``; the ground truth is the list ``sent``.
"""

from __future__ import annotations

import anyio
import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import stopline
from stopline import OpStatus, ReadBack, Verdict
from stopline.integrations import pydantic_ai as sl

pytestmark = pytest.mark.timeout(30)


class Refunds:
    """The destination: what was really sent; ``hold`` keeps a call in flight."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.started = anyio.Event()
        self.hold: anyio.Event | None = None

    async def send_refund(self, order: int) -> str:
        self.started.set()
        if self.hold is not None:
            await self.hold.wait()
        self.sent.append(order)
        return f"refunded {order}"


def asking_output(call_id: str) -> FunctionModel:
    """A model that answers with the output function, under ``call_id``."""

    async def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        name = info.output_tools[0].name
        return ModelResponse(parts=[ToolCallPart(name, {"order": 9}, tool_call_id=call_id)])

    return FunctionModel(model)


async def test_an_output_function_is_an_operation_and_is_not_sent_again_when_replayed(
    ledger: stopline.Ledger,
) -> None:
    refunds = Refunds()
    agent = Agent(asking_output("o1"), output_type=[refunds.send_refund])
    async with sl.run(ledger, owner="user:1", run_id="pai-out-1") as s:
        result = await s.run(agent, "refund order 9")
        assert result.output == "refunded 9" and refunds.sent == [9]
        # the same output call again (a model asked again, a retried agent run): its
        # recorded answer, nothing sent
        again = await s.run(agent, "refund order 9")
    assert again.output == "refunded 9" and refunds.sent == [9]
    (op,) = await ledger.backend.operations("pai-out-1")
    assert (op.id, op.tool, op.status) == ("pai-out-1/tool:o1", "send_refund", OpStatus.COMMITTED)


async def test_an_output_function_cut_by_a_cancel_is_in_doubt_not_undone(
    ledger: stopline.Ledger,
) -> None:
    refunds = Refunds()
    refunds.hold = anyio.Event()  # never set: the function is cut while it runs
    agent = Agent(asking_output("o1"), output_type=[refunds.send_refund])
    sessions: list[sl.AgentSession] = []

    async def agent_run() -> None:
        async with sl.run(ledger, owner="user:1", run_id="pai-out-2") as s:
            sessions.append(s)
            await s.run(agent, "refund order 9")

    async with anyio.create_task_group() as tg:
        tg.start_soon(agent_run)
        await refunds.started.wait()
        await sessions[0].cancel(by="user:1")
    (op,) = await ledger.backend.operations("pai-out-2")
    # no read-back declared: in doubt (for a person), never "not committed"
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW), op.status
    assert refunds.sent == []


async def test_an_output_function_cut_by_a_cancel_is_read_back_by_its_verifier(
    ledger: stopline.Ledger,
) -> None:
    """``verify={name: ...}`` declares the output function's read-back, as a tool's."""
    refunds = Refunds()
    refunds.hold = anyio.Event()

    async def verify(ctx: stopline.CallContext) -> ReadBack:
        there = 9 in refunds.sent
        return ReadBack(Verdict.COMMITTED if there else Verdict.NOT_COMMITTED, ended=True)

    agent = Agent(asking_output("o1"), output_type=[refunds.send_refund])
    sessions: list[sl.AgentSession] = []

    async def agent_run() -> None:
        verifiers = {"send_refund": verify}
        async with sl.run(ledger, owner="user:1", run_id="pai-out-5", verify=verifiers) as s:
            sessions.append(s)
            await s.run(agent, "refund order 9")

    async with anyio.create_task_group() as tg:
        tg.start_soon(agent_run)
        await refunds.started.wait()
        await sessions[0].cancel(by="user:1")
    await ledger.wait_settled("pai-out-5", timeout=20)
    (op,) = await ledger.backend.operations("pai-out-5")
    assert op.status is OpStatus.NOT_COMMITTED and refunds.sent == []
    kinds = [e.kind for e in await ledger.backend.events("pai-out-5") if e.op_id == op.id]
    assert kinds.index("lost") < kinds.index("verified_not_committed")


async def test_a_plain_output_and_a_read_output_function_pass_no_gate(
    ledger: stopline.Ledger,
) -> None:
    async def text(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(parts=[TextPart("done")])

    async with sl.run(ledger, owner="user:1", run_id="pai-out-3") as s:
        assert (await s.run(Agent(FunctionModel(text)), "hi")).output == "done"
    refunds = Refunds()
    agent = Agent(asking_output("o1"), output_type=[refunds.send_refund])
    async with sl.run(ledger, owner="user:1", run_id="pai-out-4", reads=["send_refund"]) as s:
        assert (await s.run(agent, "look")).output == "refunded 9"
    assert await ledger.backend.operations("pai-out-3") == []
    assert await ledger.backend.operations("pai-out-4") == []
