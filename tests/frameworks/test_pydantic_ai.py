"""Pydantic AI through stopline: the peers probe, resume, S1, S3 and S9.

The model is Pydantic AI's own ``FunctionModel``: a script that asks for tool
calls with fixed ids, and answers in text once every call has a return.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import FunctionToolset

import stopline
from stopline import Cause, Headline, OpStatus, ReadBack, Verdict
from stopline.integrations import pydantic_ai as sl
from tests.frameworks.effects import AsyncEffect, SyncEffect, until_unknown

pytestmark = pytest.mark.timeout(30)


def returned(messages: list[ModelMessage]) -> dict[str, Any]:
    return {
        part.tool_name: part.content
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart)
    }


class Script:
    """A model that asks for ``wanted`` tools (new ids each time) until all have returned."""

    def __init__(self, *wanted: str, order: str = "9") -> None:
        self.wanted = wanted
        self.order = order
        self.turns = 0
        self.thinking: anyio.Event | None = None  # when set: wait for it before answering

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.turns += 1
        if self.thinking is not None:
            await self.thinking.wait()
        done = returned(messages)
        missing = [name for name in self.wanted if name not in done]
        if not missing:
            return ModelResponse(parts=[TextPart(f"done: {sorted(done.values())}")])
        return ModelResponse(
            parts=[
                ToolCallPart(name, {"order": self.order}, tool_call_id=f"t{self.turns}-{name}")
                for name in missing
            ]
        )


class Session:
    """An agent run started in a task group."""

    def __init__(self) -> None:
        self.handle: sl.AgentSession | None = None
        self.ready = anyio.Event()
        self.entries = 0
        self.output: Any = None

    @property
    def s(self) -> sl.AgentSession:
        assert self.handle is not None
        return self.handle

    async def __call__(
        self, ledger: stopline.Ledger, agent: Agent[None, str], run_id: str, **kwargs: Any
    ) -> None:
        async with sl.run(ledger, owner="user:1", run_id=run_id) as s:
            self.handle = s
            self.entries += 1
            self.ready.set()
            result = await s.run(agent, **kwargs)
            self.output = result.output


async def test_probe_pydantic_ai_sync_tool_commits_after_cancel_and_resume_repeats_nothing(
    ledger: stopline.Ledger,
) -> None:
    """peers.md: ``RunCancelled`` raised, the sync tool committed later with no return."""
    reserve = AsyncEffect("reserve")
    refund = SyncEffect("refund", hold=True)

    async def reserve_stock(order: str) -> str:
        """Reserve stock."""
        return await reserve(order)

    def issue_refund(order: str) -> str:
        """Refund an order."""
        return refund(order)

    script = Script("reserve_stock", "issue_refund")
    tools = sl.gated(FunctionToolset([reserve_stock, issue_refund]))
    agent = Agent(FunctionModel(script), toolsets=[tools])
    session = Session()
    with refund.released_at_exit():
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: session(ledger, agent, "pai-probe", user_prompt="refund 9"))
            await refund.wait_reached()
            at_cancel = await session.s.cancel(by="user:1", reason="stop")
            assert at_cancel.run_state is stopline.RunState.CANCELLING
            await until_unknown(ledger, "pai-probe/tool:t1-issue_refund")
            refund.release.set()
    receipt = await ledger.wait_settled("pai-probe", timeout=10)
    ops = {op.id: op for op in await ledger.backend.operations("pai-probe")}
    assert set(ops) == {"pai-probe/tool:t1-reserve_stock", "pai-probe/tool:t1-issue_refund"}
    late = ops["pai-probe/tool:t1-issue_refund"]
    assert late.status is OpStatus.COMMITTED and late.cause is Cause.USER_CANCEL
    assert late.result == "refund:9"
    assert any(e.data.get("late") for e in await ledger.backend.events("pai-probe"))
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    cancelled = session.s.cancelled
    assert cancelled is not None  # Pydantic AI's RunCancelled, kept for resume
    kept = cancelled.all_messages()
    assert "issue_refund" not in returned(kept)  # what Pydantic AI alone would resume from

    # resume: the committed call gets its recorded return; the model asks for nothing again
    await ledger.resume("pai-probe", by="user:1")
    async with sl.run(ledger, owner="user:1", run_id="pai-probe") as s:
        history = await s.history(kept)
        result = await s.run(agent, message_history=history)
    assert result.output == "done: ['refund:9', 'reserve:9']"
    assert reserve.effects == ["9"] and refund.effects == ["9"]  # neither repeated
    assert session.entries == 1  # the cancelled run's block was not re-entered
    assert (await ledger.receipt("pai-probe")).headline is Headline.COMPLETED


async def test_s01_pydantic_ai_cancel_before_the_tool_call(
    unwatched: stopline.Ledger, ledger_url: str
) -> None:
    """Cancelled from another process while the model thinks: the gate refuses the call."""
    ledger = unwatched  # a worker that does not watch: its gate is where it learns
    refund = AsyncEffect("refund")

    async def issue_refund(order: str) -> str:
        """Refund an order."""
        return await refund(order)

    script = Script("issue_refund")
    script.thinking = anyio.Event()
    agent = Agent(FunctionModel(script), toolsets=[sl.gated(FunctionToolset([issue_refund]))])
    session = Session()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: session(ledger, agent, "pai-s01", user_prompt="refund 9"))
        await session.ready.wait()
        async with stopline.open(ledger_url) as elsewhere:
            first = await elsewhere.cancel("pai-s01", by="user:1")
        assert first.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
        script.thinking.set()
    receipt = await ledger.wait_settled("pai-s01", timeout=10)
    assert refund.effects == []
    assert [line.status for line in receipt.lines] == [OpStatus.PREVENTED]
    assert receipt.message == "Canceled before external action."


async def test_s01_pydantic_ai_cancel_from_another_process_stops_the_thinking(
    ledger: stopline.Ledger, ledger_url: str
) -> None:
    """A worker that watches (the default): a cancel committed by another process
    interrupts the model's thinking; the model never answers, nothing is called."""
    refund = AsyncEffect("refund")

    async def issue_refund(order: str) -> str:
        """Refund an order."""
        return await refund(order)

    script = Script("issue_refund")
    script.thinking = anyio.Event()  # never set: only the cancel ends the thinking
    agent = Agent(FunctionModel(script), toolsets=[sl.gated(FunctionToolset([issue_refund]))])
    session = Session()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: session(ledger, agent, "pai-s01w", user_prompt="refund 9"))
        await session.ready.wait()
        async with stopline.open(ledger_url) as elsewhere:
            await elsewhere.cancel("pai-s01w", by="user:1")
        receipt = await ledger.wait_settled("pai-s01w", timeout=30)
    assert refund.effects == []
    assert receipt.lines == ()
    assert receipt.message == "Canceled before external action."


async def test_s03_pydantic_ai_cancel_after_commit_before_response(
    ledger: stopline.Ledger,
) -> None:
    """The provider committed; the run is cancelled before its answer: unknown, then verified."""
    truth: dict[str, str] = {}
    committed = anyio.Event()

    async def notify(order: str) -> str:
        """Notify the customer."""
        truth["notify"] = order
        committed.set()
        await anyio.sleep_forever()  # the answer never comes back
        return "unreachable"

    async def read_back(ctx: stopline.CallContext) -> ReadBack:
        found = "notify" in truth
        return ReadBack(Verdict.COMMITTED if found else Verdict.NOT_COMMITTED, "notify:1")

    tools = sl.gated(FunctionToolset([notify]), verify={"notify": read_back})
    agent = Agent(FunctionModel(Script("notify")), toolsets=[tools])
    session = Session()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: session(ledger, agent, "pai-s03", user_prompt="notify"))
        await committed.wait()
        await session.s.cancel(by="user:1")
    receipt = await ledger.wait_settled("pai-s03", timeout=10)
    (op,) = await ledger.backend.operations("pai-s03")
    kinds = [e.kind for e in await ledger.backend.events("pai-s03") if e.op_id == op.id]
    assert kinds.index("lost") < kinds.index("verified_committed")  # unknown, then proven
    assert op.status is OpStatus.COMMITTED and op.cause is Cause.USER_CANCEL
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_s09_pydantic_ai_late_success_after_cancel(ledger: stopline.Ledger) -> None:
    """The remote answers after the run was cancelled: kept, committed, run not restarted."""
    accepted = anyio.Event()

    async def pay(order: str) -> str:
        """Pay the supplier."""
        accepted.set()
        await anyio.sleep_forever()  # the local side waits; the cancel aborts this wait
        return "unreachable"

    async def still_processing(ctx: stopline.CallContext) -> ReadBack:
        return ReadBack(Verdict.UNKNOWN, detail="the PSP has not answered yet")

    tools = sl.gated(FunctionToolset([pay]), verify={"pay": still_processing})
    script = Script("pay")
    agent = Agent(FunctionModel(script), toolsets=[tools])
    session = Session()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: session(ledger, agent, "pai-s09", user_prompt="pay"))
        await accepted.wait()
        await session.s.cancel(by="user:1")
    (op,) = await ledger.backend.operations("pai-s09")
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)  # R3: not "not sent"
    late = await ledger.late_response(op.id, Verdict.COMMITTED, result="paid", ref="psp:1")
    assert late.status is OpStatus.COMMITTED and late.result == "paid"
    receipt = await ledger.wait_settled("pai-s09", timeout=10)
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert any(e.data.get("late") for e in await ledger.backend.events("pai-s09"))
    assert session.entries == 1 and script.turns == 1  # neither the run nor the model restarted
