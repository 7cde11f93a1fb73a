"""Fixtures of the framework tests."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from agents import set_tracing_disabled
from agents.mcp import MCPServerStdio, MCPServerStdioParams
from fastmcp.client.transports import StdioTransport
from pydantic_ai.mcp import MCPToolset

import stopline
from tests.conftest import FAST_VERIFY
from tests.mcp.conftest import ROOT


@pytest.fixture
async def unwatched(ledger_url: str) -> AsyncIterator[stopline.Ledger]:
    """A worker's ledger that does not watch for cancels committed by other processes
    (``cancel_poll_ms=0``, as behind a pooler with no notifications): such a cancel
    reaches its runs at their next gate, which is what the "cancel before the call"
    scenarios prove. With the watch, the same cancel would interrupt the model's
    thinking first, and which comes first would be a race."""
    assert ledger_url.startswith("sqlite:///")
    async with stopline.open(f"{ledger_url}?cancel_poll_ms=0", verify=FAST_VERIFY) as opened:
        yield opened


# -- stopline's testing MCP server over real stdio, attached the frameworks' own way ----


def server_args(db: str) -> list[str]:
    return ["-m", "stopline.integrations.mcp.testing", "--db", db]


@pytest.fixture(scope="module")
async def pai_server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[MCPToolset[Any]]:
    """Pydantic AI's ``MCPToolset``: one connection (one server process) for the module."""
    db = str(tmp_path_factory.mktemp("pai-server") / "effects.db")
    transport = StdioTransport(sys.executable, server_args(db), env=dict(os.environ), cwd=str(ROOT))
    toolset: MCPToolset[Any] = MCPToolset(transport, tool_error_behavior="error", init_timeout=30)
    async with toolset:
        yield toolset


@pytest.fixture(scope="module")
async def oa_server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[MCPServerStdio]:
    """The OpenAI Agents SDK's ``MCPServerStdio``, one for the module."""
    set_tracing_disabled(True)
    params = oa_params(str(tmp_path_factory.mktemp("oa-server") / "effects.db"))
    async with MCPServerStdio(params, name="testing", client_session_timeout_seconds=30) as server:
        yield server


def oa_params(db: str) -> MCPServerStdioParams:
    """The testing server on ``db``, as the OpenAI Agents SDK's ``MCPServerStdio`` starts it."""
    return {
        "command": sys.executable,
        "args": server_args(db),
        "env": dict(os.environ),
        "cwd": str(ROOT),
    }
