"""Issue 20 for a Pydantic AI agent's tool: the truth matrix, printed
(tests/support/truth_frameworks.py). The model is Pydantic AI's own
``FunctionModel``, offline. ``STOPLINE_TRUTH_MATRIX=full`` runs every policy
and verifier at every point.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

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
from stopline.integrations import pydantic_ai as sl
from tests.support.truth_frameworks import Thinking, check_family
from tests.support.truth_tools import Provider

FULL = os.environ.get("STOPLINE_TRUTH_MATRIX") == "full"
pytestmark = pytest.mark.timeout(600 if FULL else 120)


class PydanticAI:
    name = "pydantic-ai"

    def agent(
        self, provider: Provider, mode: str, tool: str, run_id: str, thinking: Thinking
    ) -> Any:
        async def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            answered = any(
                isinstance(part, ToolReturnPart)
                for message in messages
                if isinstance(message, ModelRequest)
                for part in message.parts
            )
            if answered:
                return ModelResponse(parts=[TextPart("paid")])
            await thinking()
            return ModelResponse(parts=[ToolCallPart(tool, {"amount": 5}, tool_call_id="c1")])

        async def pay(ctx: RunContext[None], amount: int) -> dict[str, Any]:
            """Pay."""
            return await provider.pay(f"{run_id}/tool:{ctx.tool_call_id}", amount, mode)

        return Agent(FunctionModel(model), tools=[Tool(pay, name=tool)])

    @asynccontextmanager
    async def session(
        self,
        ledger: stopline.Ledger,
        run_id: str,
        policy: stopline.Policy,
        settings: dict[str, Any],
    ) -> AsyncIterator[Any]:
        async with sl.run(ledger, owner="user:1", run_id=run_id, policy=policy, **settings) as s:
            yield s

    async def run(self, session: Any, agent: Any) -> None:
        await session.run(agent, "pay 5")

    async def bare(self, agent: Any) -> None:
        await agent.run("pay 5")


async def test_issue20_pydantic_ai_tool_truth_matrix(tmp_path: Path) -> None:
    await check_family(PydanticAI(), tmp_path, FULL)
