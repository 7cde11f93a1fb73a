"""ADR 0063 in the frameworks' MCP read-backs, against a server of the shape before it.

The server (``tests.mcp.test_verify_tracked_compat``, over real stdio, attached the
frameworks' own way) says "never saw the key: not_committed" for every key, with no
``tracked`` field; its ``pay`` commits (kept apart from any verify record), then never
answers. Before, the adapters believed that answer: a call of ``pay`` cut after it
committed was settled ``not_committed``, a receipt saying an effect that happened did
not. Nobody declares ``pay`` tracked, so "never saw" proves nothing: review.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from agents import Agent as OaAgent
from agents import set_tracing_disabled
from agents.mcp import MCPServerStdio, MCPServerStdioParams
from agents.testing import ScriptedModel, function_call
from fastmcp.client.transports import StdioTransport
from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import stopline
from stopline import OpStatus
from stopline.integrations import openai_agents as oa
from stopline.integrations import pydantic_ai as pai
from tests.frameworks.test_mcp_verify_tracked import cut
from tests.mcp.conftest import ROOT

pytestmark = pytest.mark.timeout(60)

OLD_SERVER = ["-m", "tests.mcp.test_verify_tracked_compat"]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def pai_old() -> AsyncIterator[MCPToolset[Any]]:
    transport = StdioTransport(sys.executable, OLD_SERVER, env=dict(os.environ), cwd=str(ROOT))
    toolset: MCPToolset[Any] = MCPToolset(transport, tool_error_behavior="error", init_timeout=30)
    async with toolset:
        yield toolset


@pytest.fixture
async def oa_old() -> AsyncIterator[MCPServerStdio]:
    set_tracing_disabled(True)
    params: MCPServerStdioParams = {
        "command": sys.executable,
        "args": OLD_SERVER,
        "env": dict(os.environ),
        "cwd": str(ROOT),
    }
    async with MCPServerStdio(params, name="old", client_session_timeout_seconds=30) as server:
        yield server


async def pay_once(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    return ModelResponse(parts=[ToolCallPart("pay", {"amount": 5}, tool_call_id="m1")])


def assert_sent_to_review(op: stopline.OperationRecord, truth: dict[str, Any]) -> None:
    assert truth["paid"] == [op.id]  # the effect happened under the call's key
    assert truth["verify_arguments"], "the old server's verify was never asked"
    # the old verify takes no tool: none was sent
    assert all(set(a) <= {"key", "wait_seconds"} for a in truth["verify_arguments"])
    assert op.status is OpStatus.NEEDS_REVIEW  # before: not_committed


async def test_pydantic_ai_an_old_servers_never_saw_is_not_believed(
    ledger: stopline.Ledger, pai_old: MCPToolset[Any]
) -> None:
    agent = Agent(FunctionModel(pay_once), toolsets=[pai_old])

    async def ctl_paid() -> dict[str, Any]:  # waits until pay has committed
        return cast(dict[str, Any], await pai_old.direct_call_tool("ctl_paid", {}))

    op = await cut(ledger, pai, "pai-old", lambda s: s.run(agent, "pay"), ctl_paid)
    assert_sent_to_review(op, await ctl_paid())


async def test_openai_agents_an_old_servers_never_saw_is_not_believed(
    ledger: stopline.Ledger, oa_old: MCPServerStdio
) -> None:
    model = ScriptedModel([[function_call("pay", {"amount": 5}, call_id="c1")]])
    agent = OaAgent(name="ops", model=model, mcp_servers=[oa_old])

    async def ctl_paid() -> dict[str, Any]:  # waits until pay has committed
        result = await oa_old.call_tool("ctl_paid", {})
        assert isinstance(result.structured_content, dict), result
        return result.structured_content

    op = await cut(ledger, oa, "oa-old", lambda s: s.stream(agent, "pay"), ctl_paid)
    assert_sent_to_review(op, await ctl_paid())
