"""Probe 6 of the Agents SDK and Pydantic AI adapters, with real agents and servers.

**A second connection to an MCP server.** A native MCP server's tool (``mcp_servers=``,
Pydantic AI's ``MCPToolset``) was declared with a read-back bound to the connection
object it was first seen through. The ledger keeps one tool per name (ADR 0078), so
the same server's tool seen through another connection (one per request, or opened
again after the first ended) was "another tool under a known name": every call of
it failed before the gate, for as long as the ledger was open. The Agents SDK
turned that into "An error occurred" for the model (nothing recorded, the run
completed); Pydantic AI's run raised ``InvalidInput`` advising ``stopline.tool(name=...)``.
Now the read-back is one declaration for one server (by its name) and one tool, and
reads an operation back through the connection its call went through.

The server is stopline's testing server over real stdio (``ctl_truth`` is what it
really did, by key), launched by each framework's own MCP client.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from agents import set_tracing_disabled
from agents.mcp import MCPServerStdio
from fastmcp import FastMCP
from fastmcp.client.transports import StdioTransport
from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.models.function import FunctionModel

import stopline
from stopline import InvalidInput, OpStatus, Policy
from stopline.integrations import openai_agents as oa
from stopline.integrations import pydantic_ai as pai
from tests.frameworks.conftest import oa_params, server_args
from tests.frameworks.test_native_mcp import Control, PaiScript, oa_agent, oa_control
from tests.mcp.conftest import ROOT

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def no_trace_export() -> None:
    set_tracing_disabled(True)


def oa_connection(db: Path) -> MCPServerStdio:
    return MCPServerStdio(oa_params(str(db)), name="testing", client_session_timeout_seconds=30)


def pai_connection(db: Path) -> MCPToolset[Any]:
    transport = StdioTransport(
        sys.executable, server_args(str(db)), env=dict(os.environ), cwd=str(ROOT)
    )
    return MCPToolset(transport, tool_error_behavior="error", init_timeout=30)


async def cut_after_commit(
    ledger: stopline.Ledger, control: Control, run_id: str, agent_run: Any
) -> str:
    """``agent_run(handles)`` held after the server committed ``notify``, then cancelled;
    the key of the call, once the run settled."""
    await control.hold("committed:notify")
    handles: list[Any] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent_run, handles)
            key = await control.reached("committed:notify")
            await handles[0].cancel(by="user:1")
        await ledger.wait_settled(run_id, timeout=30)
    finally:
        await control.release("committed:notify")
    return key


async def test_openai_agents_a_second_connection_to_an_mcp_server_is_gated_and_read_back(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    db = tmp_path / "effects.db"
    first = oa_connection(db)
    async with first, oa.run(ledger, owner="user:1", run_id="p6-oa-conn-1") as s:
        await s.stream(oa_agent(first, "upload", "Q3", "c1"), "upload")
    async with oa_connection(db) as second:  # the first one has ended
        control = oa_control(second)
        async with oa.run(ledger, owner="user:1", run_id="p6-oa-conn-2") as s:
            result = await s.stream(oa_agent(second, "upload", "Q4", "c1"), "upload")
        assert result.final_output == "done"
        (op,) = await ledger.backend.operations("p6-oa-conn-2")
        assert op.status is OpStatus.COMMITTED
        assert len(await control.effects_of(op.id)) == 1

        async def agent_run(handles: list[Any]) -> None:
            async with oa.run(ledger, owner="user:1", run_id="p6-oa-conn-3") as s:
                handles.append(s)
                await s.stream(oa_agent(second, "notify", "#finance", "c1"), "notify")

        key = await cut_after_commit(ledger, control, "p6-oa-conn-3", agent_run)
        assert len(await control.effects_of(key)) == 1
    op = await ledger.backend.get_operation(key)
    # read back through the connection the call went through, not the first (ended)
    assert op.status is OpStatus.COMMITTED
    kinds = [e.kind for e in await ledger.backend.events("p6-oa-conn-3") if e.op_id == key]
    assert kinds.index("lost") < kinds.index("verified_committed")


async def test_pydantic_ai_a_second_connection_to_an_mcp_server_is_gated_and_read_back(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    db = tmp_path / "effects.db"
    async with pai_connection(db) as first:
        agent = Agent(FunctionModel(PaiScript("upload", "Q3")), toolsets=[first])
        async with pai.run(ledger, owner="user:1", run_id="p6-pai-conn-1") as s:
            await s.run(agent, "upload")
    async with pai_connection(db) as second:  # the first one has ended
        control = Control(second.direct_call_tool)
        agent = Agent(FunctionModel(PaiScript("upload", "Q4")), toolsets=[second])
        async with pai.run(ledger, owner="user:1", run_id="p6-pai-conn-2") as s:
            result = await s.run(agent, "upload")
        op_id = "p6-pai-conn-2/tool:m1"
        assert result.output == f"done: {{'id': '{op_id}', 'tool': 'upload', 'value': 'Q4'}}"
        assert len(await control.effects_of(op_id)) == 1

        async def agent_run(handles: list[Any]) -> None:
            notify = Agent(FunctionModel(PaiScript("notify", "#finance")), toolsets=[second])
            async with pai.run(
                ledger, owner="user:1", run_id="p6-pai-conn-3", policy=Policy.IMMEDIATE
            ) as s:
                handles.append(s)
                await s.run(notify, "notify")

        key = await cut_after_commit(ledger, control, "p6-pai-conn-3", agent_run)
        assert len(await control.effects_of(key)) == 1
    op = await ledger.backend.get_operation(key)
    assert op.status is OpStatus.COMMITTED
    kinds = [e.kind for e in await ledger.backend.events("p6-pai-conn-3") if e.op_id == key]
    assert kinds.index("lost") < kinds.index("verified_committed")


def in_process_server(effects: list[str]) -> FastMCP:
    """A FastMCP server in this process (``MCPToolset(server)``: FastMCP's in-memory
    transport), recording each effect it makes."""
    server = FastMCP("inproc")

    @server.tool
    def upload(payload: str) -> str:
        effects.append(payload)
        return f"uploaded {payload}"

    return server


async def test_pydantic_ai_a_second_toolset_on_an_in_process_server_is_gated(
    ledger: stopline.Ledger,
) -> None:
    """A toolset made per request on one in-process server: the server is the object
    its transport calls, so the second is the same server and its call is gated (it
    was refused before its gate, as another tool under a known name)."""
    effects: list[str] = []
    server = in_process_server(effects)
    for n in (1, 2):
        async with MCPToolset(server) as toolset:
            agent = Agent(FunctionModel(PaiScript("upload", f"Q{n}")), toolsets=[toolset])
            async with pai.run(ledger, owner="user:1", run_id=f"p6-pai-inproc-{n}") as s:
                result = await s.run(agent, "upload")
        assert result.output == f"done: uploaded Q{n}"
        (op,) = await ledger.backend.operations(f"p6-pai-inproc-{n}")
        assert op.status is OpStatus.COMMITTED
    assert effects == ["Q1", "Q2"]


async def test_pydantic_ai_another_in_process_server_of_the_same_name_stays_another(
    ledger: stopline.Ledger,
) -> None:
    """Two in-process servers that give one name are two servers: the second's tool is
    refused before its gate (one's "not found" would end the other's call), nothing
    recorded, no effect."""
    first_effects: list[str] = []
    second_effects: list[str] = []
    async with MCPToolset(in_process_server(first_effects)) as toolset:
        agent = Agent(FunctionModel(PaiScript("upload", "Q1")), toolsets=[toolset])
        async with pai.run(ledger, owner="user:1", run_id="p6-pai-inproc-a") as s:
            await s.run(agent, "upload")
    async with MCPToolset(in_process_server(second_effects)) as toolset:
        agent = Agent(FunctionModel(PaiScript("upload", "Q2")), toolsets=[toolset])
        with pytest.raises(InvalidInput, match="names another tool in this ledger"):
            async with pai.run(ledger, owner="user:1", run_id="p6-pai-inproc-b") as s:
                await s.run(agent, "upload")
    assert first_effects == ["Q1"]
    assert second_effects == []
    assert await ledger.backend.operations("p6-pai-inproc-b") == []
