"""ADR 0063 in the frameworks' own MCP read-backs: "no record of the key" proves "not
committed" only for a tool whose every call the server records.

The server is stopline's testing server over real stdio, attached the frameworks' own
way (Pydantic AI's ``MCPToolset``, the Agents SDK's ``MCPServerStdio``). ``upload`` is
tracked (recorded through ``Effects``, ``io.stopline/tracked``); ``unrecorded`` commits
with no record and says so. Before, the adapters' ``stopline_verify`` named no tool: the
server, which has untracked tools, could only answer ``unknown`` for a key it never saw,
so a call of ``upload`` cut before its request left was sent to review although the
server's record proves it never ran; and the reason given for ``unrecorded`` named
another tool.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
from agents import Agent as OaAgent
from agents import RunContextWrapper, set_tracing_disabled
from agents.mcp import MCPServerStdio
from agents.mcp.util import MCPToolMetaContext
from agents.testing import ScriptedModel, function_call
from fastmcp.client.transports import StdioTransport
from pydantic_ai import Agent
from pydantic_ai.mcp import CallToolFunc, MCPToolset
from pydantic_ai.models.function import FunctionModel
from pydantic_ai.tools import RunContext
from pydantic_ai.usage import RunUsage

import stopline
from stopline import OpStatus, Policy
from stopline.integrations import openai_agents as oa
from stopline.integrations import pydantic_ai as pai
from tests.frameworks.conftest import oa_params, server_args
from tests.frameworks.test_native_mcp import Control, PaiScript, oa_control
from tests.mcp.conftest import ROOT

pytestmark = pytest.mark.timeout(60)

HELD = "held-before-sending"  # the payload whose request a client hook holds back


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


class Outbox:
    """A framework's own hook before a request is written: it holds a call whose
    payload is ``HELD`` (the request never leaves), and says when one is there."""

    def __init__(self) -> None:
        self.reached = anyio.Event()

    async def hold_if_asked(self, arguments: dict[str, Any] | None) -> None:
        if (arguments or {}).get("payload") == HELD:
            self.reached.set()
            await anyio.sleep_forever()


@pytest.fixture(scope="module")
def outbox() -> Outbox:
    return Outbox()


@pytest.fixture(scope="module")
async def pai_held(
    tmp_path_factory: pytest.TempPathFactory, outbox: Outbox
) -> AsyncIterator[MCPToolset[Any]]:
    async def process_tool_call(
        ctx: RunContext[Any], call_tool: CallToolFunc, name: str, args: dict[str, Any]
    ) -> Any:
        await outbox.hold_if_asked(args)
        return await call_tool(name, args)

    db = str(tmp_path_factory.mktemp("pai-tracked") / "effects.db")
    transport = StdioTransport(sys.executable, server_args(db), env=dict(os.environ), cwd=str(ROOT))
    toolset: MCPToolset[Any] = MCPToolset(
        transport, tool_error_behavior="error", init_timeout=30, process_tool_call=process_tool_call
    )
    async with toolset:
        yield toolset


@pytest.fixture(scope="module")
async def oa_held(
    tmp_path_factory: pytest.TempPathFactory, outbox: Outbox
) -> AsyncIterator[MCPServerStdio]:
    async def resolver(context: MCPToolMetaContext) -> dict[str, Any] | None:
        await outbox.hold_if_asked(context.arguments)
        return None

    set_tracing_disabled(True)
    params = oa_params(str(tmp_path_factory.mktemp("oa-tracked") / "effects.db"))
    async with MCPServerStdio(
        params, name="testing", client_session_timeout_seconds=30, tool_meta_resolver=resolver
    ) as server:
        yield server


async def cut(
    ledger: stopline.Ledger,
    adapter: Any,
    run_id: str,
    drive: Callable[[Any], Awaitable[Any]],
    reached: Callable[[], Awaitable[Any]],
) -> stopline.OperationRecord:
    """A run of ``adapter`` (``pai`` or ``oa``) whose one call is cut (an immediate
    cancel) once ``reached`` returns; ``drive(session)`` runs the agent. The call's
    operation, settled."""
    handles: list[Any] = []

    async def agent_run() -> None:
        async with adapter.run(ledger, owner="user:1", run_id=run_id, policy=Policy.IMMEDIATE) as s:
            handles.append(s)
            await drive(s)

    async with anyio.create_task_group() as tg:
        tg.start_soon(agent_run)
        await reached()
        await handles[0].cancel(by="user:1")
    await ledger.wait_settled(run_id, timeout=30)
    (op,) = await ledger.backend.operations(run_id)
    return op


async def pai_cut(
    ledger: stopline.Ledger,
    server: MCPToolset[Any],
    run_id: str,
    tool: str,
    payload: str,
    reached: Callable[[], Awaitable[Any]],
) -> stopline.OperationRecord:
    agent = Agent(FunctionModel(PaiScript(tool, payload)), toolsets=[server])
    return await cut(ledger, pai, run_id, lambda s: s.run(agent, tool), reached)


async def oa_cut(
    ledger: stopline.Ledger,
    server: MCPServerStdio,
    run_id: str,
    tool: str,
    payload: str,
    reached: Callable[[], Awaitable[Any]],
) -> stopline.OperationRecord:
    model = ScriptedModel([[function_call(tool, {"payload": payload}, call_id="c1")]])
    agent = OaAgent(name="ops", model=model, mcp_servers=[server])
    return await cut(ledger, oa, run_id, lambda s: s.stream(agent, tool), reached)


async def read_back_details(ledger: stopline.Ledger, run_id: str) -> str:
    """Every event and note of the run, as text: where the read-back's reason is kept."""
    events = await ledger.backend.events(run_id)
    return "\n".join(repr(e.data) for e in events)


async def unrecorded_cut(
    ledger: stopline.Ledger, control: Control, cut: Callable[..., Awaitable[Any]], server: Any
) -> tuple[stopline.OperationRecord, str]:
    point = "committed:unrecorded"
    await control.hold(point)
    run_id = f"cut-unrecorded-{type(server).__name__}"
    try:
        op = await cut(ledger, server, run_id, "unrecorded", "p", lambda: control.reached(point))
    finally:
        await control.release(point)
    assert len(await control.effects_of(op.id)) == 1  # it happened
    return op, await read_back_details(ledger, run_id)


async def test_pydantic_ai_a_cut_call_to_an_untracked_tool_is_not_settled_not_committed(
    ledger: stopline.Ledger, pai_held: MCPToolset[Any]
) -> None:
    op, details = await unrecorded_cut(
        ledger, Control(pai_held.direct_call_tool), pai_cut, pai_held
    )
    assert op.status is OpStatus.NEEDS_REVIEW
    # the verify named the tool, and the server said it does not record it (before: no
    # tool named, and the reason given was another tool's)
    assert "does not record calls of tool 'unrecorded'" in details, details


async def test_openai_agents_a_cut_call_to_an_untracked_tool_is_not_settled_not_committed(
    ledger: stopline.Ledger, oa_held: MCPServerStdio
) -> None:
    op, details = await unrecorded_cut(ledger, oa_control(oa_held), oa_cut, oa_held)
    assert op.status is OpStatus.NEEDS_REVIEW
    assert "does not record calls of tool 'unrecorded'" in details, details


async def test_pydantic_ai_a_tracked_tools_key_the_server_never_saw_is_not_committed(
    ledger: stopline.Ledger, pai_held: MCPToolset[Any], outbox: Outbox
) -> None:
    """Cut before its request left (the client's hook holds it): the server's record,
    which holds every call of ``upload``, never saw the key. Before: unknown, review."""
    outbox.reached = anyio.Event()
    op = await pai_cut(ledger, pai_held, "pai-never-sent", "upload", HELD, outbox.reached.wait)
    assert op.status is OpStatus.NOT_COMMITTED
    assert await Control(pai_held.direct_call_tool).effects_of(op.id) == []


async def test_openai_agents_a_tracked_tools_key_the_server_never_saw_is_not_committed(
    ledger: stopline.Ledger, oa_held: MCPServerStdio, outbox: Outbox
) -> None:
    outbox.reached = anyio.Event()
    op = await oa_cut(ledger, oa_held, "oa-never-sent", "upload", HELD, outbox.reached.wait)
    assert op.status is OpStatus.NOT_COMMITTED
    assert await oa_control(oa_held).effects_of(op.id) == []


async def test_the_name_the_server_knows_a_tool_by_under_a_framework_rename(
    pai_held: MCPToolset[Any], oa_held: MCPServerStdio
) -> None:
    """A framework may list an MCP tool under another name (a prefix, a rename, the
    server's name): the verify must name the tool as the server knows it."""
    from stopline.integrations._openai_mcp import mcp_tool_name  # new: imported here, so
    from stopline.integrations._pydantic_ai_mcp import mcp_name  # the rest runs without

    ctx = RunContext(deps=None, model=FunctionModel(PaiScript("x", "y")), usage=RunUsage())
    renamed = pai_held.renamed({"send_it": "upload"}).prefixed("p")
    tools = await pai.gated(renamed).get_tools(ctx)
    assert mcp_name(tools["p_send_it"]) == "upload" and mcp_name(tools["p_echo"]) == "echo"
    config: Any = {"include_server_in_tool_names": True}
    agent = OaAgent(name="ops", mcp_servers=[oa_held], mcp_config=config)
    listed = {t.name: t for t in await agent.get_mcp_tools(RunContextWrapper(context=None))}
    public = next(name for name in listed if name.endswith("__upload"))
    assert public != "upload"
    body = listed[public].on_invoke_tool  # type: ignore[union-attr]
    assert mcp_tool_name(getattr(body, "_invoke_tool_impl", None) or body) == "upload"
