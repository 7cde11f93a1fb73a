"""Probe 14 of the Pydantic AI adapter (ADR 0121): a tool that says, by Pydantic AI's own
exceptions, that it did not run.

A tool may decide per call that it needs approval (``raise ApprovalRequired()`` unless
``ctx.tool_call_approved``) or that it is to be run elsewhere (``raise CallDeferred()``):
Pydantic AI ends the agent run with ``DeferredToolRequests``; the tool did nothing.
The gate recorded the call ``unknown`` (any exception but ``Rejected``: it may have
happened): the receipt said "may have happened; verifying" of a call that never ran;
and once a person approved it and the run was resumed, Pydantic AI ran the tool again
under the same call id, and the gate, meeting its own record in doubt, did not send it:
the approved refund was never made. Both are recorded ``not_committed`` now, and
Pydantic AI gets its own exception back.

Real agents with Pydantic AI's ``FunctionModel``, real SQLite ledgers.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic_ai import (
    Agent,
    ApprovalRequired,
    CallDeferred,
    DeferredToolRequests,
    ModelRetry,
    RunContext,
)
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import stopline
from stopline import Headline, OpStatus, RunState
from stopline.integrations import pydantic_ai as sl
from tests.frameworks.effects import statuses

pytestmark = pytest.mark.timeout(30)


def one_call(tool: str, args: dict[str, Any], call_id: str) -> FunctionModel:
    """A model that asks for one call, then answers with the last tool return it read."""

    def reply(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart(tool, args, tool_call_id=call_id)])
        return ModelResponse(parts=[TextPart("done")])

    return FunctionModel(reply)


def asks_approval(done: list[str]) -> Agent[None, str | DeferredToolRequests]:
    agent = Agent(one_call("refund", {"order": "7"}, "r1"), output_type=[str, DeferredToolRequests])

    @agent.tool
    async def refund(ctx: RunContext[object], order: str) -> str:
        """Refund an order, once a person approved it."""
        if not ctx.tool_call_approved:
            raise ApprovalRequired()
        done.append(order)
        return f"refunded {order}"

    return agent


async def test_a_tool_that_asks_for_approval_is_not_in_doubt_and_runs_once_approved(
    ledger: stopline.Ledger,
) -> None:
    """``ApprovalRequired`` from the tool: the run is paused with the call recorded as not
    done (never "may have happened"); approved and resumed, the refund is made once.
    Failed on the old code: ``unknown``, "verifying", and the approved call refused."""
    done: list[str] = []
    agent = asks_approval(done)
    async with sl.run(ledger, owner="user:1", run_id="p14-appr", approver="manager:1") as s:
        first = await s.run(agent, "refund order 7")
    assert isinstance(first.output, DeferredToolRequests)
    receipt = await ledger.receipt("p14-appr")
    assert receipt.run_state is RunState.PAUSED and receipt.headline is Headline.PAUSED
    assert await statuses(ledger, "p14-appr") == {"tool:r1": OpStatus.NOT_COMMITTED}
    assert "ApprovalRequired" in str(receipt.lines[0].evidence[-1].detail)
    (approval,) = await ledger.backend.approvals("p14-appr")
    assert approval.scope == "p14-appr/tool:r1"

    await ledger.approve(approval.id, by="manager:1")
    await ledger.resume("p14-appr", by="user:1")
    async with sl.run(ledger, owner="user:1", run_id="p14-appr") as s:
        again = await s.run(agent, message_history=first.all_messages())
    assert again.output == "done"
    assert done == ["7"]
    assert await statuses(ledger, "p14-appr") == {"tool:r1": OpStatus.COMMITTED}
    assert (await ledger.receipt("p14-appr")).headline is Headline.COMPLETED


async def test_a_tool_that_asks_for_approval_and_is_denied_is_not_sent(
    ledger: stopline.Ledger,
) -> None:
    """Denied: the call is not made, and its record says it did not happen."""
    done: list[str] = []
    agent = asks_approval(done)
    async with sl.run(ledger, owner="user:1", run_id="p14-deny", approver="manager:1") as s:
        first = await s.run(agent, "refund order 7")
    (approval,) = await ledger.backend.approvals("p14-deny")
    await ledger.deny(approval.id, by="manager:1")
    await ledger.resume("p14-deny", by="user:1")
    async with sl.run(ledger, owner="user:1", run_id="p14-deny") as s:
        await s.run(agent, message_history=first.all_messages())
    assert done == []
    assert await statuses(ledger, "p14-deny") == {"tool:r1": OpStatus.NOT_COMMITTED}


async def test_a_call_the_tool_defers_is_recorded_not_run(ledger: stopline.Ledger) -> None:
    """``CallDeferred``: the tool runs nothing here; the receipt says so (never
    "verifying"). Failed on the old code: ``unknown``."""
    agent = Agent(one_call("refund", {"order": "7"}, "r1"), output_type=[str, DeferredToolRequests])

    @agent.tool
    async def refund(ctx: RunContext[object], order: str) -> str:
        """Refund an order (a back office runs it)."""
        raise CallDeferred()

    async with sl.run(ledger, owner="user:1", run_id="p14-def") as s:
        result = await s.run(agent, "refund order 7")
    assert isinstance(result.output, DeferredToolRequests)
    assert [call.tool_call_id for call in result.output.calls] == ["r1"]
    assert await statuses(ledger, "p14-def") == {"tool:r1": OpStatus.NOT_COMMITTED}
    receipt = await ledger.receipt("p14-def")
    assert receipt.headline is not Headline.VERIFYING
    assert "CallDeferred" in str(receipt.lines[0].evidence[-1].detail)


async def test_an_output_function_that_refuses_is_not_in_doubt_and_the_model_asks_again(
    ledger: stopline.Ledger,
) -> None:
    """``raise ModelRetry(...) from stopline.Rejected(...)`` in an output function, as in a
    tool: it refused before acting (``not_committed``), the model is asked again, and its
    second call is sent. Failed on the old code: the refusal was recorded ``unknown``."""
    sent: list[int] = []

    async def send_refund(order: int) -> str:
        """Refund an order (a positive one)."""
        if order <= 0:
            raise ModelRetry("the order must be positive") from stopline.Rejected("bad order")
        sent.append(order)
        return f"refunded {order}"

    def reply(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        name = info.output_tools[0].name
        order, call_id = (0, "o1") if len(messages) == 1 else (9, "o2")
        return ModelResponse(parts=[ToolCallPart(name, {"order": order}, tool_call_id=call_id)])

    agent = Agent(FunctionModel(reply), output_type=[send_refund])
    async with sl.run(ledger, owner="user:1", run_id="p14-out") as s:
        result = await s.run(agent, "refund order 9")
    assert result.output == "refunded 9" and sent == [9]
    assert await statuses(ledger, "p14-out") == {
        "tool:o1": OpStatus.NOT_COMMITTED,
        "tool:o2": OpStatus.COMMITTED,
    }
    assert (await ledger.receipt("p14-out")).headline is Headline.COMPLETED
