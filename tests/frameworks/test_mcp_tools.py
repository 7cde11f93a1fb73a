"""MCP tools through the framework adapters: each call goes through ``StoplineMCP``.

The server is the real fault-injecting testing server over stdio
(``stopline.integrations.mcp.testing``), holding calls at barriers the test
controls; the models are the frameworks' own local test models. No sleeps.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, TypedDict

import anyio
import pytest
from agents import Agent as OaAgent
from agents import set_tracing_disabled
from agents.testing import ScriptedModel, assistant_message, function_call
from langchain_core.messages import AIMessage, AnyMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
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

import stopline
from stopline import Cause, Headline, OpStatus, Policy
from stopline.integrations import langgraph as lg
from stopline.integrations import openai_agents as oa
from stopline.integrations import pydantic_ai as pai
from tests.mcp.conftest import Server, open_server

pytestmark = pytest.mark.timeout(60)

TOOLS = ["upload", "notify", "lookup"]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    async for opened in open_server("stdio-legacy", tmp_path_factory.mktemp("mcp-tools")):
        yield opened


async def op_kinds(ledger: stopline.Ledger, run_id: str, op_id: str) -> list[str]:
    return [e.kind for e in await ledger.backend.events(run_id) if e.op_id == op_id]


# -- Pydantic AI -----------------------------------------------------------------------


def pai_returns(messages: list[ModelMessage]) -> dict[str, Any]:
    return {
        part.tool_name: part.content
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart)
    }


class PaiScript:
    """Asks for ``tool`` once (id ``t1-<tool>``), then answers with what it returned."""

    def __init__(self, tool: str, payload: str) -> None:
        self.tool = tool
        self.payload = payload
        self.turns = 0
        self.seen: list[str] = []  # the tool names the model was offered

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.turns += 1
        self.seen = sorted(t.name for t in info.function_tools)
        done = pai_returns(messages)
        if self.tool in done:
            return ModelResponse(parts=[TextPart(f"done: {done[self.tool]}")])
        call = ToolCallPart(self.tool, {"payload": self.payload}, tool_call_id=f"t1-{self.tool}")
        return ModelResponse(parts=[call])


class PaiSession:
    """A Pydantic AI agent run in a stopline run, started in a task group."""

    def __init__(self) -> None:
        self.handle: pai.AgentSession | None = None
        self.entries = 0

    @property
    def s(self) -> pai.AgentSession:
        assert self.handle is not None
        return self.handle

    async def __call__(
        self,
        ledger: stopline.Ledger,
        agent: Agent[None, str],
        run_id: str,
        policy: Policy = Policy.VERIFY,
    ) -> None:
        async with pai.run(ledger, owner="user:1", run_id=run_id, policy=policy) as s:
            self.handle = s
            self.entries += 1
            await s.run(agent, "go")


async def test_pydantic_ai_mcp_call_commits_and_shows_in_the_receipt(
    ledger: stopline.Ledger, server: Server
) -> None:
    script = PaiScript("upload", "Q3 report")
    agent = Agent(FunctionModel(script), toolsets=[pai.mcp_toolset(server.conn, include=TOOLS)])
    async with pai.run(ledger, owner="user:1", run_id="pai-mcp-ok") as s:
        result = await s.run(agent, "upload the report")
    op_id = "pai-mcp-ok/tool:t1-upload"
    assert result.output == f"done: {{'id': '{op_id}', 'tool': 'upload', 'value': 'Q3 report'}}"
    assert script.seen == sorted(TOOLS)  # the server's listing, stopline_verify and ctl_* left out
    op = await ledger.backend.get_operation(op_id)
    assert op.status is OpStatus.COMMITTED and op.tool == "testing/upload"
    receipt = await ledger.receipt("pai-mcp-ok")
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.COMPLETED
    assert len(await server.effects_of(op_id)) == 1  # the key in _meta is the operation id


async def test_pydantic_ai_mcp_cancel_while_the_server_holds_the_call(
    ledger: stopline.Ledger, server: Server
) -> None:
    """Verify policy, cancelled before the server accepted: the server is asked, and its own
    record confirms that nothing was done."""
    await server.hold("received:upload")
    agent = Agent(
        FunctionModel(PaiScript("upload", "draft")),
        toolsets=[pai.mcp_toolset(server.conn, include=TOOLS)],
    )
    session = PaiSession()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(session, ledger, agent, "pai-mcp-cancel")
            key = await server.reached("received:upload")
            await session.s.cancel(by="user:1")
        receipt = await ledger.wait_settled("pai-mcp-cancel", timeout=20)
    finally:
        await server.release("received:upload")
    assert key == "pai-mcp-cancel/tool:t1-upload"
    op = await ledger.backend.get_operation(key)
    assert op.status is OpStatus.NOT_COMMITTED and op.cancel_state == "confirmed"
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert await server.effects_of(key) == []
    assert session.entries == 1


async def test_pydantic_ai_mcp_cancel_after_commit_then_resume_repeats_nothing(
    ledger: stopline.Ledger, server: Server
) -> None:
    """Immediate policy, committed, the answer held back: cut, unknown, verified committed by
    stopline_verify; on resume the same tool_call_id gets the recorded result."""
    await server.hold("committed:notify")
    script = PaiScript("notify", "#finance")
    agent = Agent(FunctionModel(script), toolsets=[pai.mcp_toolset(server.conn, include=TOOLS)])
    session = PaiSession()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(session, ledger, agent, "pai-mcp-s03", Policy.IMMEDIATE)
            key = await server.reached("committed:notify")
            await session.s.cancel(by="user:1")
        receipt = await ledger.wait_settled("pai-mcp-s03", timeout=20)
    finally:
        await server.release("committed:notify")
    op = await ledger.backend.get_operation(key)
    assert op.status is OpStatus.COMMITTED and op.cause is Cause.USER_CANCEL
    kinds = await op_kinds(ledger, "pai-mcp-s03", key)
    assert kinds.index("lost") < kinds.index("verified_committed")  # unknown, then proven
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS

    # resume: the model asks for the same call again (same tool_call_id): the gate knows it
    await ledger.resume("pai-mcp-s03", by="user:1")
    async with pai.run(ledger, owner="user:1", run_id="pai-mcp-s03") as s:
        result = await s.run(agent, "go")
    assert result.output == f"done: {op.result}"
    assert script.turns == 3  # the cut turn, then the replayed call and the answer
    assert len(await server.effects_of(key)) == 1  # not repeated


# -- OpenAI Agents SDK -----------------------------------------------------------------


@pytest.fixture
def no_trace_export() -> None:
    """Nothing leaves the machine: the SDK's tracing exporter stays off."""
    set_tracing_disabled(True)


def oa_agent(server: Server, tool: str, payload: str, call_id: str = "") -> OaAgent[Any]:
    model = ScriptedModel(
        [
            [function_call(tool, {"payload": payload}, call_id=call_id or f"call_{tool}")],
            [assistant_message("done")],
        ]
    )
    return OaAgent(name="ops", model=model, tools=oa.mcp_tools(server.conn, include=TOOLS))


class OaSession:
    """An Agents SDK run in a stopline run, started in a task group."""

    def __init__(self) -> None:
        self.handle: oa.AgentSession | None = None
        self.entries = 0

    @property
    def s(self) -> oa.AgentSession:
        assert self.handle is not None
        return self.handle

    async def __call__(
        self,
        ledger: stopline.Ledger,
        agent: OaAgent[Any],
        run_id: str,
        policy: Policy = Policy.VERIFY,
    ) -> None:
        async with oa.run(ledger, owner="user:1", run_id=run_id, policy=policy) as s:
            self.handle = s
            self.entries += 1
            await s.stream(agent, "go")


@pytest.mark.usefixtures("no_trace_export")
async def test_openai_agents_mcp_call_commits_and_shows_in_the_receipt(
    ledger: stopline.Ledger, server: Server
) -> None:
    agent = oa_agent(server, "upload", "Q3 report")
    assert sorted(t.name for t in agent.tools) == sorted(TOOLS)
    async with oa.run(ledger, owner="user:1", run_id="oa-mcp-ok") as s:
        result = await s.stream(agent, "upload the report")
    assert result.final_output == "done"
    op_id = "oa-mcp-ok/tool:call_upload"
    op = await ledger.backend.get_operation(op_id)
    assert op.status is OpStatus.COMMITTED and op.tool == "testing/upload"
    assert op.result == {"id": op_id, "tool": "upload", "value": "Q3 report"}
    receipt = await ledger.receipt("oa-mcp-ok")
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.COMPLETED
    assert len(await server.effects_of(op_id)) == 1


@pytest.mark.usefixtures("no_trace_export")
async def test_openai_agents_mcp_cancel_while_the_server_holds_the_call(
    ledger: stopline.Ledger, server: Server
) -> None:
    """Verify policy: the server is asked to cancel; its own record confirms nothing was done."""
    await server.hold("received:upload")
    session = OaSession()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(session, ledger, oa_agent(server, "upload", "draft"), "oa-mcp-cancel")
            key = await server.reached("received:upload")
            await session.s.cancel(by="user:1")
        receipt = await ledger.wait_settled("oa-mcp-cancel", timeout=20)
    finally:
        await server.release("received:upload")
    assert key == "oa-mcp-cancel/tool:call_upload"
    op = await ledger.backend.get_operation(key)
    assert op.status is OpStatus.NOT_COMMITTED and op.cancel_state == "confirmed"
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert await server.effects_of(key) == []
    assert session.entries == 1


@pytest.mark.usefixtures("no_trace_export")
async def test_openai_agents_mcp_cancel_after_commit_then_replay_repeats_nothing(
    ledger: stopline.Ledger, server: Server
) -> None:
    """Immediate policy, committed, the answer held back: cut, unknown, verified committed by
    stopline_verify; on resume the same call_id gets the recorded result."""
    await server.hold("committed:notify")
    session = OaSession()
    agent = oa_agent(server, "notify", "#finance")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(session, ledger, agent, "oa-mcp-s03", Policy.IMMEDIATE)
            key = await server.reached("committed:notify")
            await session.s.cancel(by="user:1")
        receipt = await ledger.wait_settled("oa-mcp-s03", timeout=20)
    finally:
        await server.release("committed:notify")
    op = await ledger.backend.get_operation(key)
    assert op.status is OpStatus.COMMITTED and op.cause is Cause.USER_CANCEL
    kinds = await op_kinds(ledger, "oa-mcp-s03", key)
    assert kinds.index("lost") < kinds.index("verified_committed")
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS

    await ledger.resume("oa-mcp-s03", by="user:1")
    async with oa.run(ledger, owner="user:1", run_id="oa-mcp-s03") as s:
        # asked again from the prompt: a new call id, the same call
        result = await s.stream(oa_agent(server, "notify", "#finance", "call_again"), "go")
    assert result.final_output == "done"
    assert len(await server.effects_of(key)) == 1  # not repeated
    assert [o.id for o in await ledger.backend.operations("oa-mcp-s03")] == [key]
    assert await server.effects_of("oa-mcp-s03/tool:call_again") == []


# -- LangGraph ---------------------------------------------------------------------------


class LgChat(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def lg_graph(server: Server, tool: str, payload: str) -> Any:
    """A scripted "model" asks for ``tool`` once (id ``call_<tool>``); a ToolNode runs it."""
    call = {"name": tool, "args": {"payload": payload}, "id": f"call_{tool}", "type": "tool_call"}

    def model(state: LgChat) -> dict[str, list[AnyMessage]]:
        return {"messages": [AIMessage(content="", tool_calls=[call])]}

    builder = StateGraph(LgChat)
    builder.add_node("model", model)
    builder.add_node("tools", ToolNode(lg.mcp_tools(server.conn)))
    builder.add_edge(START, "model")
    builder.add_edge("model", "tools")
    builder.add_edge("tools", END)
    return builder.compile(checkpointer=InMemorySaver())


async def test_langgraph_mcp_call_commits_and_shows_in_the_receipt(
    ledger: stopline.Ledger, server: Server
) -> None:
    graph = lg_graph(server, "upload", "Q3 report")
    async with lg.run(ledger, owner="user:1", thread_id="lg-mcp-ok") as g:
        await g.ainvoke(graph, {"messages": []})
    op_id = "lg-mcp-ok/tool:call_upload"
    op = await ledger.backend.get_operation(op_id)
    assert op.status is OpStatus.COMMITTED and op.tool == "testing/upload"
    receipt = await ledger.receipt("lg-mcp-ok")
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert len(await server.effects_of(op_id)) == 1


async def test_langgraph_mcp_cancel_while_the_server_holds_the_call(
    ledger: stopline.Ledger, server: Server
) -> None:
    """Verify policy: the server is asked to cancel; its own record confirms nothing was done."""
    await server.hold("received:upload")
    handles: list[lg.GraphRun] = []
    graph = lg_graph(server, "upload", "draft")

    async def workflow() -> None:
        async with lg.run(ledger, owner="user:1", thread_id="lg-mcp-cancel") as g:
            handles.append(g)
            await g.ainvoke(graph, {"messages": []})

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow)
            key = await server.reached("received:upload")
            await handles[0].cancel(by="user:1")
        receipt = await ledger.wait_settled("lg-mcp-cancel", timeout=20)
    finally:
        await server.release("received:upload")
    assert key == "lg-mcp-cancel/tool:call_upload"
    op = await ledger.backend.get_operation(key)
    assert op.status is OpStatus.NOT_COMMITTED and op.cancel_state == "confirmed"
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert await server.effects_of(key) == []


def test_the_adapters_mcp_tools_take_idle_timeout_and_warn_on_timeout() -> None:
    """ADR 0030: the silence allowed in each call is ``idle_timeout``; ``timeout=`` is
    its deprecated name (still the silence in 0.2)."""
    from stopline.integrations.mcp import StoplineMCP

    conn = StoplineMCP("http://127.0.0.1:9/mcp")  # never opened: no tools are listed
    assert pai.mcp_toolset(conn, idle_timeout=5).idle_timeout == 5
    with pytest.warns(DeprecationWarning, match=r"mcp_toolset\(timeout=\)"):
        assert pai.mcp_toolset(conn, timeout=7).idle_timeout == 7
    with pytest.warns(DeprecationWarning, match=r"MCPToolset\(timeout=\)"):
        assert pai.MCPToolset(conn, timeout=8).idle_timeout == 8
    for adapter in (lg, oa):
        assert adapter.mcp_tools(conn, idle_timeout=5) == []
        with pytest.warns(DeprecationWarning, match=r"mcp_tools\(timeout=\)"):
            adapter.mcp_tools(conn, timeout=5)


@pytest.mark.usefixtures("no_trace_export")
@pytest.mark.parametrize("arguments", ['{"payload": ', '["x"]'], ids=["cut", "list"])
async def test_openai_agents_mcp_arguments_that_are_no_object_pass_no_gate(
    ledger: stopline.Ledger, server: Server, arguments: str
) -> None:
    """The model's arguments for an MCP tool are cut short or not an object: no request
    can be made of them. The call passes no gate, and the model is told as the SDK's
    own MCP tools tell it (the failure text), instead of the run failing."""
    model = ScriptedModel(
        [[function_call("upload", arguments, call_id="c1")], [assistant_message("done")]]
    )
    agent = OaAgent(name="ops", model=model, tools=oa.mcp_tools(server.conn, include=TOOLS))
    async with oa.run(ledger, owner="user:1", run_id="oa-mcp-args") as s:
        result = await s.stream(agent, "go")
    assert result.final_output == "done"
    assert await ledger.backend.operations("oa-mcp-args") == []
    told = str(model.last_call.input if model.last_call else "")
    assert "An error occurred while running the tool" in told
