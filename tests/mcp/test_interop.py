"""Interop with MCP implementations stopline did not write, over stdio and Streamable HTTP
(2026-07-28, where tasks are an extension):

- stopline's client against a FastMCP 4.1 server whose tools run as ``fastmcp-tasks``
  background tasks (SEP-2663);
- stopline's server (the testing server, with ``TasksServer``) consumed by FastMCP's
  own client and by Pydantic AI's ``MCPToolset``.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from fastmcp import Client as FastMCPClient
from fastmcp.client.transports import StdioTransport, StreamableHttpTransport
from fastmcp_tasks import call_tool_task
from pydantic_ai.mcp import MCPToolset

import stopline
from mcp import StdioServerParameters
from stopline import OpStatus, PhaseKind, Policy
from stopline.integrations.mcp import StoplineMCP
from tests.mcp.conftest import (
    ROOT,
    Server,
    open_server,
    serve_http,
    server_env,
    stdio_params,
)
from tests.scenarios.workflows import Started, start

pytestmark = pytest.mark.timeout(40)
FASTMCP_SERVER = ["-m", "tests.support.fastmcp_tasks_server"]
KINDS = ["stdio", "http"]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


# -- stopline's client, FastMCP's server -------------------------------------------------------
@pytest.fixture(scope="module")
def fastmcp_url() -> Iterator[str]:
    with serve_http(*FASTMCP_SERVER) as url:
        yield url


@pytest.fixture(params=KINDS)
async def fastmcp_server(request: pytest.FixtureRequest) -> AsyncIterator[StoplineMCP]:
    target: StdioServerParameters | str
    if request.param == "stdio":
        target = StdioServerParameters(
            command=sys.executable, args=FASTMCP_SERVER, cwd=str(ROOT), env=server_env()
        )
    else:
        target = str(request.getfixturevalue("fastmcp_url"))
    async with StoplineMCP(target, mode="2026-07-28", name="fastmcp", tasks=True) as conn:
        yield conn


async def test_interop_stopline_client_fastmcp_tasks_server_commits(
    ledger: stopline.Ledger, fastmcp_server: StoplineMCP
) -> None:
    """FastMCP answers with its own CreateTaskResult; stopline polls its tasks/get."""
    async with ledger.run("interop", owner="user:1") as run:
        result = await fastmcp_server.call(run, "quick", {"payload": "hello"})
    op = (await ledger.backend.operations(run.id))[0]
    assert result == {"value": "hello"}
    assert op.status is OpStatus.COMMITTED
    task_refs = [e.ref for e in op.evidence if e.ref.startswith("task:")]
    assert len(task_refs) == 1 and len(task_refs[0]) > len("task:") + 40  # FastMCP's 256-bit id


async def test_interop_stopline_client_fastmcp_tasks_cancel_is_not_proof(
    ledger: stopline.Ledger, fastmcp_server: StoplineMCP
) -> None:
    """FastMCP acknowledges tasks/cancel and ends the task ``cancelled``; it offers no
    record of what the work did, so stopline never calls that not_committed."""

    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
            await fastmcp_server.call(run, "stuck", {"payload": "x"})

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await started.ready.wait()
        while not (ops := await ledger.backend.operations(started.run_id)) or (
            ops[0].status is not OpStatus.ACCEPTED
        ):
            await ledger.wait_for_change(started.run_id)  # the task exists: accepted
        await ledger.cancel(started.run_id, by="user:1")
    op_id = ops[0].id
    while True:
        events = await ledger.backend.events(started.run_id)
        text = " ".join(str(e.data) for e in events if e.op_id == op_id)
        if "ended cancelled" in text:
            break
        await ledger.wait_for_change(started.run_id)
    assert "acknowledged" in text  # the cancel, recorded as a request
    op = await ledger.backend.get_operation(op_id)
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)  # cancelled proves nothing


# -- stopline's server, FastMCP's client and Pydantic AI's -----------------------------------------
@pytest.fixture(params=KINDS)
def stopline_target(request: pytest.FixtureRequest, tmp_path: Path) -> StdioTransport | str:
    if request.param == "stdio":
        params = stdio_params(tmp_path / "effects.db")
        return StdioTransport(
            command=params.command, args=list(params.args), env=params.env, cwd=str(ROOT)
        )
    return str(request.getfixturevalue("http_url"))


@pytest.fixture
async def truth(tmp_path: Path, stopline_target: StdioTransport | str) -> AsyncIterator[Server]:
    """A stopline connection to the same server, to read its ground truth."""
    if isinstance(stopline_target, str):
        transport, http = "http-2026", stopline_target
    else:
        transport, http = "stdio-2026", None
    async for opened in open_server(transport, tmp_path, http):
        yield opened


def _fastmcp(target: StdioTransport | str) -> FastMCPClient[Any]:
    transport = target if isinstance(target, StdioTransport) else StreamableHttpTransport(target)
    return FastMCPClient(transport, mode="2026-07-28")


async def test_interop_fastmcp_client_drives_a_stopline_task(
    stopline_target: StdioTransport | str, truth: Server
) -> None:
    """FastMCP's client reads stopline's CreateTaskResult and DetailedTask as its own."""
    key = "interop-fastmcp-1"
    async with _fastmcp(stopline_target) as client:
        task = await call_tool_task(
            client, "upload", {"payload": "p"}, meta={"io.stopline/key": key}
        )
        assert len(task.task_id) >= 43  # stopline's ids: 256 random bits
        result = await task.result()
    assert result.structured_content == {"id": key, "tool": "upload", "value": "p"}
    assert len(await truth.effects_of(key)) == 1  # over stdio: another process, the same file


async def test_interop_fastmcp_client_cancels_a_stopline_task(
    stopline_target: StdioTransport | str,
) -> None:
    """FastMCP's tasks/cancel reaches stopline's server; the task ends cancelled and the
    server says what that means: nothing was committed."""
    key = "interop-fastmcp-cancel"
    async with _fastmcp(stopline_target) as client:
        await client.call_tool("ctl_hold", {"point": "received:upload"})
        task = await call_tool_task(
            client, "upload", {"payload": "p"}, meta={"io.stopline/key": key}
        )
        await client.call_tool("ctl_reached", {"point": "received:upload"})
        await task.cancel()
        status = await task.wait(timeout=20)  # FastMCP polls tasks/get to a terminal state
        await client.call_tool("ctl_release", {"point": "received:upload"})
        verify = await client.call_tool("stopline_verify", {"key": key})
    assert status.status == "cancelled"
    assert verify.structured_content is not None
    assert verify.structured_content["verdict"] == "not_committed"


async def test_interop_pydantic_ai_toolset_calls_stopline_tools(
    stopline_target: StdioTransport | str, truth: Server
) -> None:
    """Pydantic AI's MCP client, with tasks (``use_task=True``) and without."""
    toolset: MCPToolset[None] = MCPToolset(_fastmcp(stopline_target))
    async with toolset:
        tools = {t.name for t in await toolset.list_tools()}
        assert {"upload", "stopline_verify"} <= tools
        as_task = await toolset.direct_call_tool(
            "upload", {"payload": "a"}, metadata={"io.stopline/key": "pai-1"}, use_task=True
        )
        inline = await toolset.direct_call_tool(
            "notify", {"payload": "b"}, metadata={"io.stopline/key": "pai-2"}
        )
        verify = await toolset.direct_call_tool("stopline_verify", {"key": "pai-1"})
    assert as_task == {"id": "pai-1", "tool": "upload", "value": "a"}
    assert inline == {"id": "pai-2", "tool": "notify", "value": "b"}
    assert verify["verdict"] == "committed"
