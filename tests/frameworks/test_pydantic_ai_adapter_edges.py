"""Pydantic AI adapter: the edges a probe found (typed arguments on resume, a tool
raising a BaseException, a result not kept, a reused call id, ``ModelRetry``).

Real agents with Pydantic AI's own ``FunctionModel``; real ledgers (SQLite and
PostgreSQL through the ``ledger`` fixture); barriers, never sleeps.
"""

from __future__ import annotations

import datetime
from typing import Any

import anyio
import pytest
from pydantic_ai import Agent
from pydantic_ai.exceptions import ModelRetry
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

import stopline
from stopline import OpStatus, RunState
from stopline.integrations import pydantic_ai as sl

pytestmark = pytest.mark.timeout(30)


def returns(messages: list[ModelMessage], outcome: str = "success") -> list[Any]:
    """The contents of the tool returns of ``messages`` with that ``outcome``."""
    return [
        part.content
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart) and part.outcome == outcome
    ]


class Ask:
    """Asks for ``tool`` with ``args`` under a new id (``<prefix><turn>``) until it has a
    return; with ``answering`` set, waits for it before answering that return."""

    def __init__(self, tool: str, args: dict[str, Any], prefix: str = "c") -> None:
        self.tool, self.args, self.prefix = tool, args, prefix
        self.turns = 0
        self.answering: anyio.Event | None = None
        self.returned = anyio.Event()
        self.seen: list[Any] = []

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.turns += 1
        done = returns(messages)
        if done:
            self.seen = done
            self.returned.set()
            if self.answering is not None:
                await self.answering.wait()
            return ModelResponse(parts=[TextPart(f"done: {done[-1]}")])
        call = ToolCallPart(self.tool, self.args, tool_call_id=f"{self.prefix}{self.turns}")
        return ModelResponse(parts=[call])


async def cancel_after_the_return(
    ledger: stopline.Ledger, agent: Agent[None, str], ask: Ask, run_id: str
) -> None:
    """The tool commits, the run is cancelled while the model answers; then resumed."""
    ask.answering = anyio.Event()
    sessions: list[sl.AgentSession] = []

    async def go() -> None:
        async with sl.run(ledger, owner="user:1", run_id=run_id) as s:
            sessions.append(s)
            await s.run(agent, "go")

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        await ask.returned.wait()
        await sessions[0].cancel(by="user:1")
    await ledger.wait_settled(run_id, timeout=10)
    await ledger.resume(run_id, by="user:1")
    ask.answering = None


async def test_resume_without_history_matches_arguments_that_are_not_plain_json(
    ledger: stopline.Ledger,
) -> None:
    """A ``date`` argument: the re-issued call compares as the gate recorded it
    (``args_digest``), so it replays instead of booking twice."""
    booked: list[tuple[str, datetime.date]] = []
    ask = Ask("book", {"room": "A", "day": "2025-03-01"})
    agent: Agent[None, str] = Agent(FunctionModel(ask))

    @agent.tool_plain
    async def book(room: str, day: datetime.date) -> str:
        """Book a room for a day."""
        booked.append((room, day))
        return f"booked {room} on {day}"

    await cancel_after_the_return(ledger, agent, ask, "pai-e-typed")
    async with sl.run(ledger, owner="user:1", run_id="pai-e-typed") as s:
        result = await s.run(agent, "go")  # no history: asked again under a new id
    assert result.output == "done: booked A on 2025-03-01"
    assert booked == [("A", datetime.date(2025, 3, 1))]
    assert [op.id for op in await ledger.backend.operations("pai-e-typed")] == [
        "pai-e-typed/tool:c1"
    ]


class Halt(BaseException):
    """Not an ``Exception``: as ``SystemExit`` or ``KeyboardInterrupt`` would be."""


async def test_def_tool_raising_a_base_exception_fails_its_own_call_only(
    ledger: stopline.Ledger,
) -> None:
    """The ``def`` tool's ``Halt`` reaches its caller, recorded as an async tool's would
    be; another owner's run in the same ledger goes on and completes."""
    other_started, other_go = anyio.Event(), anyio.Event()
    paid: list[str] = []
    payer: Agent[None, str] = Agent(FunctionModel(Ask("pay", {"order": "a"})))

    @payer.tool_plain
    def pay(order: str) -> str:
        """Pay."""
        paid.append(order)
        raise Halt("halt after paying")

    other: Agent[None, str] = Agent(FunctionModel(Ask("slow", {"x": "1"})))

    @other.tool_plain
    async def slow(x: str) -> str:
        """Harmless, waits for the test."""
        other_started.set()
        await other_go.wait()
        return "ok"

    async def unrelated() -> None:
        async with sl.run(ledger, owner="user:2", run_id="pai-e-other") as s:
            await s.run(other, "go")

    async with anyio.create_task_group() as tg:
        tg.start_soon(unrelated)
        await other_started.wait()
        with pytest.raises(Halt):
            async with sl.run(ledger, owner="user:1", run_id="pai-e-halt") as s:
                await s.run(payer, "pay")
        other_go.set()
    assert paid == ["a"]
    assert (await ledger.backend.get_run("pai-e-other")).state is RunState.COMPLETED
    op = await ledger.backend.get_operation("pai-e-halt/tool:c1")
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)  # in doubt, never lost


async def test_history_repair_says_a_result_that_was_not_kept(ledger: stopline.Ledger) -> None:
    """The call committed with a result that is not JSON (not kept): the history's
    missing return says so, never ``None``."""
    ask = Ask("allocate", {"n": 3})
    agent: Agent[None, str] = Agent(FunctionModel(ask))

    @agent.tool_plain
    async def allocate(n: int) -> set[int]:
        """Allocate n slots."""
        return set(range(n))  # not JSON: the ledger keeps its digest only

    await cancel_after_the_return(ledger, agent, ask, "pai-e-unkept")
    # the history as kept before the call's return reached it
    cut: list[ModelMessage] = [
        ModelRequest.user_text_prompt("go"),
        ModelResponse(parts=[ToolCallPart("allocate", {"n": 3}, tool_call_id="c1")]),
    ]
    async with sl.run(ledger, owner="user:1", run_id="pai-e-unkept") as s:
        repaired = await s.history(cut)
    (content,) = returns(repaired)
    assert isinstance(content, str)
    assert "result was not kept" in content and "Do not call it again" in content


async def test_resume_without_history_tells_the_model_a_result_was_not_kept(
    ledger: stopline.Ledger,
) -> None:
    """The re-issued call is the recorded one; its result was not kept: the model is
    told so (the run goes on), and nothing is sent again."""
    allocated: list[int] = []
    ask = Ask("allocate", {"n": 3})
    agent: Agent[None, str] = Agent(FunctionModel(ask))

    @agent.tool_plain
    async def allocate(n: int) -> set[int]:
        """Allocate n slots."""
        allocated.append(n)
        return set(range(n))

    await cancel_after_the_return(ledger, agent, ask, "pai-e-unkept2")
    async with sl.run(ledger, owner="user:1", run_id="pai-e-unkept2") as s:
        await s.run(agent, "go")
    assert allocated == [3]
    assert "result was not kept" in str(ask.seen[-1])


async def test_a_call_id_reused_with_other_arguments_is_refused_naming_the_cause(
    ledger: stopline.Ledger,
) -> None:
    """ADR 0054: the model's second call under the first one's id, other arguments."""
    refunded: list[str] = []
    turns = [0]

    async def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turns[0] += 1
        if turns[0] > 2:
            return ModelResponse(parts=[TextPart("done")])
        order = "1042" if turns[0] == 1 else "2077"
        return ModelResponse(parts=[ToolCallPart("refund", {"order": order}, "call_0")])

    agent: Agent[None, str] = Agent(FunctionModel(model))

    @agent.tool_plain
    async def refund(order: str) -> str:
        """Refund."""
        refunded.append(order)
        return f"refunded {order}"

    with pytest.raises(stopline.InvalidInput, match="reused a call id") as raised:
        async with sl.run(ledger, owner="user:1", run_id="pai-e-reused") as s:
            await s.run(agent, "refund both")
    assert isinstance(raised.value.__cause__, stopline.IdempotencyConflict)
    assert refunded == ["1042"]


async def test_model_retry_from_rejected_is_not_committed_and_asks_again(
    ledger: stopline.Ledger,
) -> None:
    """``raise ModelRetry(...) from stopline.Rejected(...)``: the tool says it did nothing;
    the attempt is ``not_committed`` and the model asks again. A bare ``ModelRetry``
    proves nothing (it stays in doubt)."""
    refunded: list[str] = []

    async def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if returns(messages):
            return ModelResponse(parts=[TextPart("refunded")])
        retried = bool(returns(messages, "retried")) or any(
            isinstance(p, RetryPromptPart) for m in messages for p in m.parts
        )
        order = "1042" if retried else "10x"
        call_id = "c2" if retried else "c1"
        return ModelResponse(parts=[ToolCallPart("refund", {"order": order}, call_id)])

    agent: Agent[None, str] = Agent(FunctionModel(model))

    @agent.tool_plain(retries=2)
    async def refund(order: str) -> str:
        """Refund an order."""
        if not order.isdigit():
            reason = f"{order!r} is not an order number"
            raise ModelRetry(reason) from stopline.Rejected(reason)
        refunded.append(order)
        return f"refunded {order}"

    async with sl.run(ledger, owner="user:1", run_id="pai-e-retry") as s:
        result = await s.run(agent, "refund")
    assert result.output == "refunded"
    assert refunded == ["1042"]
    ops = {op.id: op.status for op in await ledger.backend.operations("pai-e-retry")}
    assert ops == {
        "pai-e-retry/tool:c1": OpStatus.NOT_COMMITTED,
        "pai-e-retry/tool:c2": OpStatus.COMMITTED,
    }
    assert (await ledger.backend.get_run("pai-e-retry")).state is RunState.COMPLETED
