"""stopline's own MCP server driven by a client stopline did not write: ``fastmcp``'s
``Client`` (its own transports, its own protocol negotiation: ``mode="auto"`` probes
``server/discover``), over real stdio and real Streamable HTTP.

Each test asks what such a client sees and what the server's own record says about
it: the handshake and listing, a keyed call, the refusals of odd input (a tool that
does not exist, arguments of the wrong type, an effect with no idempotency key), and
a cancel that lands while the tool is held inside the server. The server's record
(``stopline_verify``, the cancellation log, the ground-truth effects) must match
what happened, whoever the client is.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from fastmcp import Client
from fastmcp.client.transports import StdioTransport
from fastmcp.exceptions import ToolError

from tests.mcp.conftest import ROOT, serve_http, server_env

pytestmark = pytest.mark.timeout(90)

KINDS = ["stdio", "http"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def plain_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """fastmcp's own ``Client``, as installed: importing ``fastmcp_tasks`` (another
    test module does) registers an extension every later ``Client`` folds in, which
    drives each call as a task and, when its caller stops waiting, abandons the task
    without a cancel. Each test here is of the plain client, whatever ran before."""
    from fastmcp.client import extension_hooks

    monkeypatch.setattr(extension_hooks, "_internal_client_extension_factories", [])


@asynccontextmanager
async def outside(kind: str, tmp: Path) -> AsyncIterator[Client[Any]]:
    db = str(tmp / "effects.db")
    if kind == "stdio":
        args = ["-m", "stopline.integrations.mcp.testing", "--db", db]
        transport = StdioTransport(sys.executable, args, env=server_env(), cwd=str(ROOT))
        async with Client(transport) as client:
            yield client
    else:
        with serve_http("-m", "stopline.integrations.mcp.testing", "--db", db) as url:
            async with Client(url) as client:
                yield client


async def ctl(client: Client[Any], name: str, **arguments: Any) -> Any:
    result = await client.call_tool(name, arguments)
    content = result.structured_content or {}
    return content.get("result", content)


async def verify(
    client: Client[Any], key: str, wait_seconds: float = 0, tool: str | None = None
) -> dict[str, Any]:
    """The server's own record of ``key`` (``stopline_verify``), sent to ``tool``."""
    arguments: dict[str, Any] = {"key": key, "wait_seconds": wait_seconds}
    if tool is not None:
        arguments["tool"] = tool
    result = await client.call_tool("stopline_verify", arguments)
    assert isinstance(result.structured_content, dict)
    return result.structured_content


def key(value: str) -> dict[str, str]:
    return {"io.stopline/key": value}


@pytest.mark.parametrize("kind", KINDS)
async def test_an_outside_client_lists_calls_and_is_refused_odd_input(
    tmp_path: Path, kind: str
) -> None:
    async with outside(kind, tmp_path) as client:
        tools = {t.name: t for t in await client.list_tools()}
        assert {"stopline_verify", "upload", "echo"} <= set(tools)
        assert (tools["upload"].meta or {}).get("io.stopline/effects") is True
        echoed = await client.call_tool("echo", {"payload": "hi"}, meta=key("outside-echo"))
        assert echoed.structured_content == {"value": "hi"}
        with pytest.raises(ToolError, match="Unknown tool"):
            await client.call_tool("no_such_tool", {})
        with pytest.raises(ToolError, match="valid string"):
            await client.call_tool("upload", {"payload": 5}, meta=key("outside-bad"))
        with pytest.raises(Exception, match="idempotency key"):  # an effect with no key
            await client.call_tool("upload", {"payload": "x"})
        uploaded = await client.call_tool("upload", {"payload": "r"}, meta=key("outside-up"))
        truth = await ctl(client, "ctl_truth")
        keys = ("outside-up", "outside-bad")
        verdicts = [(await verify(client, k, tool="upload"))["verdict"] for k in keys]
    assert uploaded.structured_content == {"id": "outside-up", "tool": "upload", "value": "r"}
    assert [e["key"] for e in truth["effects"]] == ["outside-up"]  # the refused made none
    # refused for its arguments: no record, of a tool that records every call it runs
    assert verdicts == ["committed", "not_committed"]


@pytest.mark.parametrize("kind", KINDS)
async def test_an_outside_clients_cancel_is_recorded_and_stops_the_tool(
    tmp_path: Path, kind: str
) -> None:
    """The tool is held inside the server when the client stops waiting (fastmcp
    cancels the request the way its transport does). The server's record says the
    request ended with nothing committed (while the tool was still held: nothing but
    the cancel could end it), and its cancellation log names the key."""
    async with outside(kind, tmp_path) as client:
        await ctl(client, "ctl_hold", point="received:upload")
        async with anyio.create_task_group() as tg:
            cut = anyio.CancelScope()

            async def cancelled_call() -> None:
                with cut:
                    await client.call_tool("upload", {"payload": "x"}, meta=key("outside-cut"))

            tg.start_soon(cancelled_call)
            assert (await ctl(client, "ctl_reached", point="received:upload"))["key"] == (
                "outside-cut"
            )
            cut.cancel()
        # still held: only the cancel can end the attempt, which the long poll waits for
        status = await verify(client, "outside-cut", wait_seconds=20, tool="upload")
        await ctl(client, "ctl_release", point="received:upload")
        truth = await ctl(client, "ctl_truth")
    assert cut.cancelled_caught
    assert status["verdict"] == "not_committed" and status["cancel"] == "stopped", status
    assert [e for e in truth["effects"] if e["key"] == "outside-cut"] == []
    logged = {c["via"] for c in truth["cancellations"] if c["key"] == "outside-cut"}
    assert "tool_stopped" in logged and logged & {"notification", "handler_cancelled"}
