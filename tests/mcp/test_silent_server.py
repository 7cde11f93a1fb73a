"""A server that accepts the connection and never answers: opening is bounded.

Over Streamable HTTP (and over stdio, a command that starts and says nothing), the
handshake waited for ever: ``StoplineMCP`` never opened nor failed, and
``stopline check-mcp --settle-timeout 2`` ran until it was killed, though its
docs say every wait is bounded. Opening now waits ``connect_timeout`` at most
(``check-mcp --connect-timeout``) and fails with a typed ``NoAnswer``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator

import anyio
import anyio.abc
import pytest

from stopline import Cause, NoAnswer
from stopline.integrations.mcp import StoplineMCP

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def silent() -> AsyncIterator[str]:
    """A TCP port that accepts every connection and never answers."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def hold(stream: anyio.abc.SocketStream) -> None:
        async with stream:  # closed when the fixture ends
            await anyio.sleep_forever()

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, hold)
        yield f"http://127.0.0.1:{port}/mcp"
        tg.cancel_scope.cancel()


async def test_opening_a_silent_server_fails_typed_within_connect_timeout(silent: str) -> None:
    with anyio.fail_after(30):  # a guard against the hang, not a timing
        with pytest.raises(NoAnswer) as refused:
            async with StoplineMCP(silent, name="silent", connect_timeout=1):
                pass
    assert refused.value.cause is Cause.TIMEOUT
    assert "no answer within 1 s of opening" in str(refused.value)


async def test_check_mcp_of_a_silent_server_ends_with_no_connection(silent: str) -> None:
    env = {**os.environ, "NO_COLOR": "1"}
    command = [sys.executable, "-m", "stopline.cli", "check-mcp", silent, "--connect-timeout", "1"]
    with anyio.fail_after(40):  # a guard against the hang, not a timing
        done = await anyio.run_process(command, env=env, check=False, stderr=subprocess.PIPE)
    assert done.returncode == 2, done.stderr
    assert b"no answer within 1 s of opening" in done.stderr
