"""Real MCP servers for the MCP suite: ``stopline.integrations.mcp.testing`` over
stdio (a subprocess per connection) and over Streamable HTTP (uvicorn in a
subprocess on a socket this process bound on 127.0.0.1, so there is no
start-up race to wait out), in both protocol eras.

Server processes are shared within a module (each test uses its own run and
so its own idempotency keys); every test gets its own ledger.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.client.stdio import get_default_environment

import stopline
from mcp import StdioServerParameters
from stopline import OpStatus, PhaseKind, Policy
from stopline.integrations.mcp import StoplineMCP

ROOT = Path(__file__).resolve().parents[2]
TRANSPORTS = ["stdio-legacy", "stdio-2026", "http-legacy", "http-2026"]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def server_env() -> dict[str, str]:
    """The SDK's default child environment, importing stopline from this checkout's ``src``
    (the SDK passes no ``PYTHONPATH``, so a child would otherwise import whichever
    stopline the interpreter has installed)."""
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return {**get_default_environment(), "PYTHONPATH": path}


def stdio_params(db: Path, *extra: str) -> StdioServerParameters:
    args = ["-m", "stopline.integrations.mcp.testing", "--db", str(db), *extra]
    return StdioServerParameters(command=sys.executable, args=args, cwd=str(ROOT), env=server_env())


@contextlib.contextmanager
def serve_http(*args: str) -> Iterator[str]:
    """``python ARGS --fd N`` serving Streamable HTTP on a socket this process bound and
    listens on, so there is no start-up race to wait out; its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, *args, "--fd", str(sock.fileno())],
        pass_fds=[sock.fileno()],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])},
        stderr=subprocess.DEVNULL,
    )
    sock.close()
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:  # a call still held at a barrier (a failed test)
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def http_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The testing server over Streamable HTTP."""
    db = tmp_path_factory.mktemp("http") / "effects.db"
    with serve_http("-m", "stopline.integrations.mcp.testing", "--db", str(db)) as url:
        yield url


class Server:
    """A connection to the testing server, with its control tools."""

    def __init__(self, conn: StoplineMCP, transport: str) -> None:
        self.conn = conn
        self.transport = transport

    @property
    def era(self) -> str:
        return self.transport.split("-")[1]

    async def ctl(self, name: str, **arguments: Any) -> Any:
        result = await self.conn.client.call_tool(name, arguments)
        assert not result.is_error, result
        if result.structured_content is not None:
            return result.structured_content.get("result", result.structured_content)
        return None

    async def hold(self, point: str) -> None:
        await self.ctl("ctl_hold", point=point)

    async def reached(self, point: str) -> str:
        return str((await self.ctl("ctl_reached", point=point))["key"])

    async def release(self, point: str) -> None:
        await self.ctl("ctl_release", point=point)

    async def fault(self, tool: str, fault: str) -> None:
        await self.ctl("ctl_fault", tool=tool, fault=fault)

    async def effects_of(self, key: str) -> list[dict[str, Any]]:
        truth = await self.ctl("ctl_truth")
        return [e for e in truth["effects"] if e["key"] == key]

    async def cancellations_of(self, key: str) -> list[dict[str, Any]]:
        truth = await self.ctl("ctl_truth")
        return [c for c in truth["cancellations"] if c["key"] == key]


async def open_server(
    transport: str, tmp: Path, http: str | None = None, *extra: str, **options: Any
) -> AsyncIterator[Server]:
    kind, era = transport.split("-")
    mode = "legacy" if era == "legacy" else "2026-07-28"
    target: StdioServerParameters | str
    target = stdio_params(tmp / "effects.db", *extra) if kind == "stdio" else str(http)
    async with StoplineMCP(target, mode=mode, name="testing", **options) as conn:
        yield Server(conn, transport)


async def wait_status(
    ledger: stopline.Ledger, op_id: str, *wanted: OpStatus
) -> stopline.OperationRecord:
    """Until the operation reaches one of ``wanted`` (ledger change notifications; no sleeps)."""
    while True:
        op = await ledger.backend.get_operation(op_id)
        if op.status in wanted:
            return op
        await ledger.wait_for_change(op.run_id)


async def cut_under_immediate(
    ledger: stopline.Ledger,
    run_id: str,
    call: Callable[[stopline.Run], Awaitable[Any]],
    reached: Callable[[], Awaitable[Any]],
    after: Callable[[], Awaitable[Any]] | None = None,
) -> tuple[stopline.Receipt, stopline.OperationRecord]:
    """A run whose one ``call`` is cut (an ``immediate`` cancel of the run) once
    ``reached`` returns (a barrier); ``after`` runs once the cancel is in. The settled
    receipt and the call's operation."""

    async def workflow() -> None:
        async with (
            ledger.run("cut", owner="user:1", run_id=run_id) as run,
            run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),
        ):
            await call(run)

    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow)
        await reached()
        await ledger.cancel(run_id, by="user:1")  # immediate: the call is cut
        if after is not None:
            await after()
    receipt = await ledger.wait_settled(run_id, timeout=60)
    return receipt, (await ledger.backend.operations(run_id))[0]
