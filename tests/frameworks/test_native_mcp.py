"""MCP servers attached the frameworks' own way, gated all the same.

The server is stopline's fault-injecting testing server over real stdio,
launched by the framework's own MCP client (Pydantic AI's ``MCPToolset``, the
Agents SDK's ``MCPServerStdio``). Its ``ctl_*`` tools hold a call at a barrier;
``ctl_truth`` is what it really did, by key. The server refuses a call without
an idempotency key in ``_meta``, so a call that reaches it ungated fails.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from agents import Agent as OaAgent
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
from stopline import Cause, Headline, OpStatus, Policy
from stopline.integrations import openai_agents as oa
from stopline.integrations import pydantic_ai as pai

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


class Control:
    """The testing server's control tools, through the framework's own connection."""

    def __init__(self, call: Any) -> None:
        self.call = call

    async def hold(self, point: str) -> None:
        await self.call("ctl_hold", {"point": point})

    async def reached(self, point: str) -> str:
        return str((await self.call("ctl_reached", {"point": point}))["key"])

    async def release(self, point: str) -> None:
        await self.call("ctl_release", {"point": point})

    async def effects_of(self, key: str) -> list[dict[str, Any]]:
        truth = await self.call("ctl_truth", {})
        return [e for e in truth["effects"] if e["key"] == key]


# -- Pydantic AI: MCPToolset ------------------------------------------------------------


class PaiScript:
    """Asks for ``tool`` under a new id each turn until it has a return."""

    def __init__(self, tool: str, payload: str) -> None:
        self.tool = tool
        self.payload = payload
        self.turns = 0

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.turns += 1
        for message in messages:
            for part in message.parts if isinstance(message, ModelRequest) else ():
                if isinstance(part, ToolReturnPart) and part.tool_name == self.tool:
                    return ModelResponse(parts=[TextPart(f"done: {part.content}")])
        call = ToolCallPart(self.tool, {"payload": self.payload}, tool_call_id=f"m{self.turns}")
        return ModelResponse(parts=[call])


async def test_pydantic_ai_native_mcp_toolset_call_is_gated_and_keyed(
    ledger: stopline.Ledger, pai_server: MCPToolset[Any]
) -> None:
    agent = Agent(FunctionModel(PaiScript("upload", "Q3")), toolsets=[pai_server])
    async with pai.run(ledger, owner="user:1", run_id="pai-n-ok") as s:
        result = await s.run(agent, "upload")
    op_id = "pai-n-ok/tool:m1"
    assert result.output == f"done: {{'id': '{op_id}', 'tool': 'upload', 'value': 'Q3'}}"
    receipt = await ledger.receipt("pai-n-ok")
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    control = Control(pai_server.direct_call_tool)
    assert len(await control.effects_of(op_id)) == 1  # the operation id travelled in _meta


async def test_pydantic_ai_native_mcp_cancel_after_commit_then_resume(
    ledger: stopline.Ledger, pai_server: MCPToolset[Any]
) -> None:
    """Committed, its answer held back, the run cancelled: unknown, then verified through
    the server's ``stopline_verify``; the resumed model's new call repeats nothing."""
    control = Control(pai_server.direct_call_tool)
    await control.hold("committed:notify")
    script = PaiScript("notify", "#finance")
    agent = Agent(FunctionModel(script), toolsets=[pai_server])
    handles: list[pai.AgentSession] = []

    async def agent_run() -> None:
        async with pai.run(
            ledger, owner="user:1", run_id="pai-n-s03", policy=Policy.IMMEDIATE
        ) as s:
            handles.append(s)
            await s.run(agent, "notify")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent_run)
            key = await control.reached("committed:notify")
            await handles[0].cancel(by="user:1")
        receipt = await ledger.wait_settled("pai-n-s03", timeout=20)
    finally:
        await control.release("committed:notify")
    assert key == "pai-n-s03/tool:m1"
    op = await ledger.backend.get_operation(key)
    assert op.status is OpStatus.COMMITTED and op.cause is Cause.USER_CANCEL
    kinds = [e.kind for e in await ledger.backend.events("pai-n-s03") if e.op_id == key]
    assert kinds.index("lost") < kinds.index("verified_committed")
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS

    await ledger.resume("pai-n-s03", by="user:1")
    async with pai.run(ledger, owner="user:1", run_id="pai-n-s03") as s:
        await s.run(agent, "notify")  # asked again: a new id, the same call
    assert len(await control.effects_of(key)) == 1
    assert [o.id for o in await ledger.backend.operations("pai-n-s03")] == [key]


# -- OpenAI Agents SDK: mcp_servers= ----------------------------------------------------


def oa_control(server: MCPServerStdio) -> Control:
    async def call(name: str, arguments: dict[str, Any]) -> Any:
        result = await server.call_tool(name, arguments)
        content = result.structured_content or {}
        return content.get("result", content)

    return Control(call)


def oa_agent(server: MCPServerStdio, tool: str, payload: str, *call_ids: str) -> OaAgent[Any]:
    steps: list[Any] = [
        [function_call(tool, {"payload": payload}, call_id=call_id)] for call_id in call_ids
    ]
    model = ScriptedModel([*steps, [assistant_message("done")]])
    return OaAgent(name="ops", model=model, mcp_servers=[server])


async def test_openai_agents_mcp_servers_call_is_gated_and_keyed(
    ledger: stopline.Ledger, oa_server: MCPServerStdio
) -> None:
    """The hole: a server attached with ``mcp_servers=`` bypassed the gate."""
    async with oa.run(ledger, owner="user:1", run_id="oa-n-ok") as s:
        result = await s.stream(oa_agent(oa_server, "upload", "Q3", "c1"), "upload")
    assert result.final_output == "done"
    op_id = "oa-n-ok/tool:c1"
    receipt = await ledger.receipt("oa-n-ok")
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert len(await oa_control(oa_server).effects_of(op_id)) == 1  # the key in _meta


async def test_openai_agents_mcp_servers_cancel_after_commit_then_resume(
    ledger: stopline.Ledger, oa_server: MCPServerStdio
) -> None:
    """Committed, its answer held back, the run cancelled: verified committed through
    ``stopline_verify``; resumed, the model's new call repeats nothing."""
    control = oa_control(oa_server)
    await control.hold("committed:notify")
    agent = oa_agent(oa_server, "notify", "#finance", "c1", "c2")
    handles: list[oa.AgentSession] = []

    async def agent_run() -> None:
        async with oa.run(ledger, owner="user:1", run_id="oa-n-s03") as s:
            handles.append(s)
            await s.stream(agent, "notify")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent_run)
            key = await control.reached("committed:notify")
            await handles[0].cancel(by="user:1")
        receipt = await ledger.wait_settled("oa-n-s03", timeout=20)
    finally:
        await control.release("committed:notify")
    assert key == "oa-n-s03/tool:c1"
    op = await ledger.backend.get_operation(key)
    assert op.status is OpStatus.COMMITTED
    kinds = [e.kind for e in await ledger.backend.events("oa-n-s03") if e.op_id == key]
    assert kinds.index("lost") < kinds.index("verified_committed")
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS

    await ledger.resume("oa-n-s03", by="user:1")
    async with oa.run(ledger, owner="user:1", run_id="oa-n-s03") as s:
        await s.stream(agent, "notify")  # asked again from the prompt: call c2
    assert len(await control.effects_of(key)) == 1
    assert [o.id for o in await ledger.backend.operations("oa-n-s03")] == [key]
