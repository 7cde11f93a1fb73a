"""Tools offered to the model under another name: a prefix, a rename (ADR 0068).

``stopline_verify`` is stopline's read-back, not the model's: it stays hidden under
whatever name the framework lists it (Pydantic AI's ``.prefixed()``/``.renamed()``,
the Agents SDK's ``include_server_in_tool_names``), and a real tool renamed
``stopline_verify`` is still the tool it is. A toolset that gates its own calls
(``mcp_toolset``, ``gated``, an agent's own ``Gate``) keeps one gate per call under
any wrapper. Real servers over stdio, the frameworks' own offline models.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from agents import Agent as OaAgent
from agents.mcp import MCPServerStdio
from agents.testing import ScriptedModel, assistant_message, function_call
from pydantic_ai import Agent, RunContext
from pydantic_ai.mcp import MCPToolset
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
from pydantic_ai.toolsets import AbstractToolset, FunctionToolset, ToolsetTool

import stopline
from stopline import Headline, OpStatus
from stopline.integrations import openai_agents as oa
from stopline.integrations import pydantic_ai as pai
from tests.frameworks.test_native_mcp import oa_control
from tests.mcp.conftest import Server, open_server

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    async for opened in open_server("stdio-legacy", tmp_path_factory.mktemp("renamed")):
        yield opened


class Once:
    """Asks for one call, then answers with what came back; keeps the names offered."""

    def __init__(self, tool: str, args: dict[str, Any], call_id: str = "c1") -> None:
        self.call = ToolCallPart(tool, args, tool_call_id=call_id)
        self.offered: list[str] = []

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.offered = sorted(t.name for t in info.function_tools)
        for message in messages:
            for part in message.parts if isinstance(message, ModelRequest) else ():
                if isinstance(part, ToolReturnPart | RetryPromptPart):
                    return ModelResponse(parts=[TextPart(f"done: {part.content}")])
        return ModelResponse(parts=[self.call])


def unrecorded_toolset(inner: pai.StoplineToolset) -> AbstractToolset[Any]:
    """A toolset of the user's own that hands every call to ``inner`` without being a
    ``WrapperToolset``: nothing stopline can see through."""

    class Relay(AbstractToolset[Any]):
        @property
        def id(self) -> str | None:
            return None

        async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
            return await inner.get_tools(ctx)

        async def call_tool(
            self, name: str, args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
        ) -> Any:
            return await inner.call_tool(name, args, ctx, tool)

    return Relay()


# -- Pydantic AI ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wrap", "verify_as", "notify_as"),
    [
        (lambda ts: ts.prefixed("srv"), "srv_stopline_verify", "srv_notify"),
        (lambda ts: ts.renamed({"check": "stopline_verify"}), "check", "notify"),
    ],
    ids=["prefixed", "renamed"],
)
async def test_pydantic_ai_verify_is_not_offered_under_a_prefix_or_a_rename(
    ledger: stopline.Ledger, pai_server: MCPToolset[Any], wrap: Any, verify_as: str, notify_as: str
) -> None:
    """The model never sees the read-back, whatever the toolset calls it; the real tool
    under the new name is gated and keyed as under its own."""
    run_id = f"pai-rn-{notify_as}"
    script = Once(notify_as, {"payload": "#finance"})
    agent = Agent(FunctionModel(script), toolsets=[wrap(pai_server)])
    async with pai.run(ledger, owner="user:1", run_id=run_id) as s:
        await s.run(agent, "notify")
    assert notify_as in script.offered and verify_as not in script.offered
    assert not [name for name in script.offered if "stopline_verify" in name]
    (op,) = await ledger.backend.operations(run_id)
    assert op.id == f"{run_id}/tool:c1" and op.status is OpStatus.COMMITTED
    effects = (await pai_server.direct_call_tool("ctl_truth", {}))["effects"]
    assert [e["tool"] for e in effects if e["key"] == op.id] == ["notify"]


async def test_pydantic_ai_a_tool_renamed_stopline_verify_is_still_that_tool(
    ledger: stopline.Ledger, pai_server: MCPToolset[Any]
) -> None:
    """Hidden by the name the server knows it by, not the one the model is shown: a real
    tool offered as ``stopline_verify`` is offered, gated and keyed."""
    own = pai_server.filtered(lambda ctx, tool: tool.name != "stopline_verify")
    script = Once("stopline_verify", {"payload": "#ops"})
    agent = Agent(FunctionModel(script), toolsets=[own.renamed({"stopline_verify": "notify"})])
    async with pai.run(ledger, owner="user:1", run_id="pai-rn-as-verify") as s:
        result = await s.run(agent, "notify")
    assert "stopline_verify" in script.offered
    assert result.output.startswith("done: {'id': 'pai-rn-as-verify/tool:c1', 'tool': 'notify'")
    (op,) = await ledger.backend.operations("pai-rn-as-verify")
    assert op.status is OpStatus.COMMITTED


@pytest.mark.parametrize(
    ("wrap", "name"),
    [
        (lambda ts: ts.prefixed("srv"), "srv_upload"),
        (lambda ts: ts.renamed({"up": "upload"}), "up"),
    ],
    ids=["prefixed", "renamed"],
)
async def test_pydantic_ai_mcp_toolset_under_a_wrapper_passes_one_gate(
    ledger: stopline.Ledger, server: Server, wrap: Any, name: str
) -> None:
    """``sl.mcp_toolset(conn)`` gates its own calls (``StoplineMCP``); under a prefix the
    run's gate gated it again under the same key and the call failed "in doubt"."""
    run_id = f"pai-rn-mcp-{name}"
    script = Once(name, {"payload": "Q3"})
    agent = Agent(FunctionModel(script), toolsets=[wrap(pai.mcp_toolset(server.conn))])
    async with pai.run(ledger, owner="user:1", run_id=run_id) as s:
        result = await s.run(agent, "upload")
    op_id = f"{run_id}/tool:c1"
    assert result.output == f"done: {{'id': '{op_id}', 'tool': 'upload', 'value': 'Q3'}}"
    (op,) = await ledger.backend.operations(run_id)
    assert op.tool == "testing/upload" and op.status is OpStatus.COMMITTED  # StoplineMCP's
    assert len(await server.effects_of(op_id)) == 1


async def test_pydantic_ai_agent_with_its_own_gate_run_in_a_session_passes_one_gate(
    ledger: stopline.Ledger,
) -> None:
    """``Agent(capabilities=[sl.Gate()])`` run by ``s.run`` (which adds the session's):
    the agent's own gate holds; the call was gated twice and failed "in doubt"."""
    paid: list[str] = []

    async def pay(order: str) -> str:
        paid.append(order)
        return f"paid {order}"

    agent = Agent(
        FunctionModel(Once("pay", {"order": "7"})), tools=[pay], capabilities=[pai.Gate()]
    )
    async with pai.run(ledger, owner="user:1", run_id="pai-rn-own-gate") as s:
        result = await s.run(agent, "pay")
    assert result.output == "done: paid 7" and paid == ["7"]
    (op,) = await ledger.backend.operations("pai-rn-own-gate")
    assert op.status is OpStatus.COMMITTED


async def test_pydantic_ai_two_gates_stopline_cannot_see_through_are_refused_naming_it(
    ledger: stopline.Ledger,
) -> None:
    """A toolset of the user's own relaying to a ``gated`` one: the second gate of the
    call is refused with ``InvalidInput`` naming it, never a wait on itself."""
    paid: list[str] = []

    async def pay(order: str) -> str:
        paid.append(order)
        return f"paid {order}"

    relay = unrecorded_toolset(pai.gated(FunctionToolset([pay])))
    agent = Agent(FunctionModel(Once("pay", {"order": "7"})), toolsets=[relay])

    async def agent_run() -> None:
        with anyio.fail_after(20):  # a bound for a broken test: a wait on itself
            async with pai.run(ledger, owner="user:1", run_id="pai-rn-two-gates") as s:
                await s.run(agent, "pay")

    with pytest.raises(stopline.InvalidInput, match="passes two stopline gates"):
        await agent_run()
    assert paid == []


# -- OpenAI Agents SDK --------------------------------------------------------------------


async def test_openai_agents_verify_is_not_offered_under_server_prefixed_names(
    ledger: stopline.Ledger, oa_server: MCPServerStdio
) -> None:
    """``include_server_in_tool_names``: the SDK lists every tool as ``mcp_<server>__<tool>``;
    ``stopline_verify`` was offered to the model under that name, and a model's call of it
    was recorded as a completed action in the receipt."""
    model = ScriptedModel(
        [
            [function_call("mcp_testing__notify", {"payload": "#ops"}, call_id="c1")],
            [assistant_message("done")],
        ]
    )
    agent = OaAgent(
        name="ops",
        model=model,
        mcp_servers=[oa_server],
        mcp_config={"include_server_in_tool_names": True},
    )
    async with oa.run(ledger, owner="user:1", run_id="oa-rn-prefixed") as s:
        result = await s.stream(agent, "notify")
    assert result.final_output == "done"
    offered = [tool.name for tool in model.calls[0].tools]
    assert "mcp_testing__notify" in offered
    assert not [name for name in offered if "stopline_verify" in name]
    op_id = "oa-rn-prefixed/tool:c1"
    (op,) = await ledger.backend.operations("oa-rn-prefixed")
    assert op.id == op_id and op.status is OpStatus.COMMITTED
    assert len(await oa_control(oa_server).effects_of(op_id)) == 1


async def test_openai_agents_prefixed_tool_cut_after_commit_is_read_back_by_its_server_name(
    ledger: stopline.Ledger, oa_server: MCPServerStdio
) -> None:
    """A call under the server-prefixed name, committed and cut by an ``immediate``
    cancel: read back through ``stopline_verify`` naming the tool as the server knows it."""
    control = oa_control(oa_server)
    await control.hold("committed:deploy")
    model = ScriptedModel([[function_call("mcp_testing__deploy", {"payload": "v2"}, call_id="c1")]])
    agent = OaAgent(
        name="ops",
        model=model,
        mcp_servers=[oa_server],
        mcp_config={"include_server_in_tool_names": True},
    )
    handles: list[oa.AgentSession] = []

    async def agent_run() -> None:
        async with oa.run(ledger, owner="user:1", run_id="oa-rn-cut") as s:
            handles.append(s)
            await s.stream(agent, "deploy")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent_run)
            key = await control.reached("committed:deploy")
            await handles[0].cancel(by="user:1")
        receipt = await ledger.wait_settled("oa-rn-cut", timeout=20)
    finally:
        await control.release("committed:deploy")
    assert key == "oa-rn-cut/tool:c1"
    op = await ledger.backend.get_operation(key)
    assert op.status is OpStatus.COMMITTED
    kinds = [e.kind for e in await ledger.backend.events("oa-rn-cut") if e.op_id == key]
    assert kinds.index("lost") < kinds.index("verified_committed")
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
