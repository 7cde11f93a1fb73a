"""Issue 20 for an OpenAI Agents SDK agent's tool: the truth matrix, printed
(tests/support/truth_frameworks.py). The model is the SDK's own
``agents.testing.ScriptedModel``, offline. ``STOPLINE_TRUTH_MATRIX=full`` runs
every policy and verifier at every point.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, Runner, function_tool, set_tracing_disabled
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call
from agents.tool_context import ToolContext

import stopline
from stopline.integrations import openai_agents as sl
from tests.support.truth_frameworks import Thinking, check_family
from tests.support.truth_tools import Provider

FULL = os.environ.get("STOPLINE_TRUTH_MATRIX") == "full"
pytestmark = pytest.mark.timeout(600 if FULL else 120)


@pytest.fixture(autouse=True)
def no_trace_export() -> None:
    """Nothing leaves the machine: the SDK's tracing exporter stays off."""
    set_tracing_disabled(True)


class OpenAIAgents:
    name = "openai-agents"

    def agent(
        self, provider: Provider, mode: str, tool: str, run_id: str, thinking: Thinking
    ) -> Any:
        async def think(call: Any) -> Any:
            await thinking()
            return [function_call(tool, {"amount": 5}, call_id="c1")]

        @function_tool(name_override=tool)
        async def pay(ctx: ToolContext[Any], amount: int) -> str:
            """Pay."""
            paid = await provider.pay(f"{run_id}/tool:{ctx.tool_call_id}", amount, mode)
            return str(paid)

        model = ScriptedModel([ModelStep.respond(think), [assistant_message("paid")]])
        return Agent(name="payer", model=model, tools=[pay])

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
        await session.stream(agent, "pay 5")

    async def bare(self, agent: Any) -> None:
        await Runner.run(agent, "pay 5")


async def test_issue20_openai_agents_tool_truth_matrix(tmp_path: Path) -> None:
    await check_family(OpenAIAgents(), tmp_path, FULL)
