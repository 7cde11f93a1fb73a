"""MCP servers attached the frameworks' own way: a tool the server declares a read
(stopline's ``_meta``; a ``readOnlyHint`` alone is untrusted, ADR 0055) or the app
declares one passes no gate, ``stopline_verify`` is not offered to the model, and
the read-back's evidence names the server the same way in every process.

The server is stopline's testing server over real stdio (its ``lookup`` is
read-only); the models are the frameworks' own offline ones.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from agents import Agent as OaAgent
from agents import RunContextWrapper
from agents.mcp import MCPServerStdio
from agents.testing import ScriptedModel, assistant_message, function_call
from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset
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
from stopline import OpStatus, Policy
from stopline.integrations import openai_agents as oa
from stopline.integrations import pydantic_ai as pai

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


class Lookup:
    """Asks for ``tool`` once, then answers; records the tools it was offered."""

    def __init__(self, tool: str, args: dict[str, Any]) -> None:
        self.tool, self.args = tool, args
        self.offered: list[str] = []

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.offered = [t.name for t in info.function_tools]
        for message in messages:
            for part in message.parts if isinstance(message, ModelRequest) else ():
                if isinstance(part, ToolReturnPart):
                    return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart(self.tool, self.args, tool_call_id="m1")])


async def test_pydantic_ai_read_only_mcp_tool_passes_no_gate_and_verify_is_not_offered(
    ledger: stopline.Ledger, pai_server: MCPToolset[Any]
) -> None:
    script = Lookup("lookup", {"key": "k"})
    agent = Agent(FunctionModel(script), toolsets=[pai_server])
    async with pai.run(ledger, owner="user:1", run_id="pai-r-lookup") as s:
        assert (await s.run(agent, "look")).output == "done"
    assert "lookup" in script.offered and "stopline_verify" not in script.offered
    assert await ledger.backend.operations("pai-r-lookup") == []
    receipt = await ledger.receipt("pai-r-lookup")
    assert receipt.message == "Completed." and not receipt.lines


async def test_pydantic_ai_mcp_read_back_names_the_server_stably(
    ledger: stopline.Ledger, pai_server: MCPToolset[Any]
) -> None:
    """Cut after the server committed: verified through ``stopline_verify``; the
    evidence names the server by the name it gave, not by an object's address."""
    await pai_server.direct_call_tool("ctl_hold", {"point": "committed:notify"})
    agent = Agent(FunctionModel(Lookup("notify", {"payload": "#x"})), toolsets=[pai_server])
    sessions: list[pai.AgentSession] = []

    async def go() -> None:
        async with pai.run(
            ledger, owner="user:1", run_id="pai-r-verify", policy=Policy.IMMEDIATE
        ) as s:
            sessions.append(s)
            await s.run(agent, "notify")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(go)
            await pai_server.direct_call_tool("ctl_reached", {"point": "committed:notify"})
            await sessions[0].cancel(by="user:1")
        await ledger.wait_settled("pai-r-verify", timeout=20)
    finally:
        await pai_server.direct_call_tool("ctl_release", {"point": "committed:notify"})
    op = await ledger.backend.get_operation("pai-r-verify/tool:m1")
    assert op.status is OpStatus.COMMITTED
    (read_back,) = [e.ref for e in op.evidence if e.ref.startswith("stopline_verify:")]
    assert read_back == f"stopline_verify:{pai_server.server_info.name}:{op.id}"


async def test_openai_a_read_hint_alone_is_gated_a_declared_read_is_not(
    ledger: stopline.Ledger, oa_server: MCPServerStdio
) -> None:
    model = ScriptedModel(
        [[function_call("lookup", {"key": "k"}, call_id="m1")], [assistant_message("done")]]
    )
    agent = OaAgent(name="reader", model=model, mcp_servers=[oa_server])
    offered = await oa.gate_agent(agent).get_mcp_tools(RunContextWrapper(None))
    names = [t.name for t in offered]
    assert "lookup" in names and "stopline_verify" not in names
    # the SDK keeps a tool's annotations, not its ``_meta``: a readOnlyHint alone is
    # untrusted (ADR 0055), so the read passes the gate unless declared a read here
    async with oa.run(ledger, owner="user:1", run_id="oa-r-lookup") as s:
        await s.stream(agent, "look")
    (gated,) = await ledger.backend.operations("oa-r-lookup")
    assert gated.tool == "lookup" and gated.status is OpStatus.COMMITTED
    again = ScriptedModel(
        [[function_call("lookup", {"key": "k"}, call_id="m2")], [assistant_message("done")]]
    )
    reader = OaAgent(name="reader", model=again, mcp_servers=[oa_server])
    async with oa.run(ledger, owner="user:1", run_id="oa-r-read", reads=("lookup",)) as s:
        await s.stream(reader, "look")
    assert await ledger.backend.operations("oa-r-read") == []
