"""The Temporal dev server helper and the session's server: a dead server is told, not
hidden, and the next test gets a live one.

The server is killed for real (SIGKILL to its process); the tests wait for its
exit (with a deadline) and connect a real client afterwards.
"""

from __future__ import annotations

import os
import signal
import socket

import anyio
import pytest
from anyio.from_thread import start_blocking_portal
from temporalio.client import Client

from stopline.integrations.temporal_server import TemporalDevServer, temporal_dev_server
from tests.engines.temporal_harness import TemporalSession


async def _until_exited(server: TemporalDevServer) -> str:
    with anyio.fail_after(10):
        return await server.wait_exited()


def _kill(server: TemporalDevServer) -> None:
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)


async def test_a_killed_dev_server_says_it_has_exited_and_how() -> None:
    async with temporal_dev_server() as server:
        assert server.exited() is None
        await Client.connect(server.address)  # up
        _kill(server)
        said = await _until_exited(server)
    assert said.startswith(f"exit status {-signal.SIGKILL}:")
    assert server.exited() == f"exit status {-signal.SIGKILL}: stopped"  # its block has left


def test_the_session_starts_another_server_when_its_server_has_died() -> None:
    with start_blocking_portal() as portal:
        session = TemporalSession(portal)
        try:
            first = session.server()
            assert session.server() is first  # alive: the same one
            _kill(first)
            portal.call(_until_exited, first)
            with pytest.warns(UserWarning, match="Temporal dev server had died"):
                second = session.server()
            assert second.pid != first.pid
            assert len(session.restarts) == 1
            assert session.restarts[0].startswith(f"exit status {-signal.SIGKILL}:")
            portal.call(Client.connect, second.address)  # the new one serves
        finally:
            session.close()


async def test_a_port_taken_between_its_pick_and_the_servers_bind_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ports are picked free, then bound by the server a moment later; another process
    on the host took one in between, and the start failed ("address already in use").
    The start is tried again on new ports. The port's holder accepts and never answers:
    the readiness probe that reached it must not hold the start (it did, until the start
    timeout, ~30 s, and CI failed): a start timeout of 20 s is far above a bounded probe
    (5 s) and below the client's own connect timeout (~30 s)."""
    from stopline.integrations import temporal_server

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])
    real = temporal_server.free_port
    monkeypatch.setattr(temporal_server, "free_port", lambda host: next(picks, None) or real(host))
    try:
        async with temporal_dev_server(start_timeout=20) as server:
            assert server.port != taken.getsockname()[1]
            await Client.connect(server.address)
    finally:
        taken.close()
