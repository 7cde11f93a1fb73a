"""A stdio MCP server under uvloop's loop (a loop we did not write; docs/mcp.md, "Under
uvloop").

uvloop's spawn (libuv) leaves duplicates of the child's standard streams open in the
child. So a server that closes its stdout while its process lives on is not seen to
break: the client reads silence, and the call ends at the silence it allows with cause
``timeout``, not ``transport``. The receipt stays true (unknown, then read back; no
second effect); only the 2026-07-28 re-issue, which follows a transport loss, does not
happen. A server whose process ends is seen at once, as on asyncio's own loop.

If uvloop stops leaking them, the first test fails: the docs then change with it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

import stopline
from stopline import Cause, OpStatus
from tests.conftest import UVLOOP
from tests.mcp.conftest import Server, open_server

pytestmark = pytest.mark.timeout(60, method="thread")  # uvloop swallows the alarm's raise


@pytest.fixture(scope="module")
def anyio_backend() -> Any:
    return UVLOOP


@pytest.fixture(scope="module", params=["stdio-legacy", "stdio-2026"])
async def plain(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Server]:
    async for opened in open_server(str(request.param), tmp_path_factory.mktemp("uvloop")):
        yield opened


# how many of the child's descriptors are its stdout (printed to stderr)
_STDOUTS = """
import os, sys
out, same = os.fstat(1), 0
for fd in range(64):
    try:
        st = os.fstat(fd)
    except OSError:
        continue
    same += (st.st_dev, st.st_ino) == (out.st_dev, out.st_ino)
print(same, file=sys.stderr)
"""


async def _stdouts_of_a_child() -> int:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _STDOUTS,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    return int(err)


async def test_the_child_holds_its_own_stdout_twice() -> None:
    """The cause: a child spawned on uvloop's loop has a second descriptor on its stdout,
    so closing fd 1 does not end the stream."""
    assert await _stdouts_of_a_child() == 2


def test_on_asyncios_own_loop_it_holds_it_once() -> None:
    """The same child spawned on asyncio's own loop: one (so the count tells them apart)."""
    assert asyncio.run(_stdouts_of_a_child()) == 1


async def test_a_broken_stream_of_a_live_server_is_silence_and_nothing_repeats(
    ledger: stopline.Ledger, plain: Server
) -> None:
    """The stream breaks after the commit, the server's process lives on: cause timeout at
    the silence allowed; the operation is read back, and the retry is answered from the
    server's record: one effect."""
    await plain.fault("upload", "break")
    async with ledger.run("s16", owner="user:1") as run:
        with pytest.raises(stopline.NoAnswer) as failed:
            await plain.conn.call(run, "upload", {"payload": "file it"}, key="t", idle_timeout=1)
        assert failed.value.cause is Cause.TIMEOUT
        retried = await plain.conn.call(run, "upload", {"payload": "file it"}, key="t")
    (op,) = await ledger.backend.operations(run.id)
    assert retried == {"id": op.id, "tool": "upload", "value": "file it"}
    assert op.status is OpStatus.COMMITTED
    assert len(await plain.effects_of(op.id)) == 1
    assert not [e for e in await ledger.backend.events(run.id) if e.kind == "mcp_reissued"]


async def test_a_server_that_dies_is_seen_at_once(ledger: stopline.Ledger, plain: Server) -> None:
    """The process ends: the transport's loss, as on asyncio's loop (no silence waited:
    the call allows far more than the test's timeout)."""
    await plain.fault("upload", "die")
    async with ledger.run("s16-die", owner="user:1") as run:
        try:
            first: Any = await plain.conn.call(
                run, "upload", {"payload": "file it"}, key="t", idle_timeout=3600
            )
        except stopline.NoAnswer as exc:
            first = exc.cause
        retried = await plain.conn.call(run, "upload", {"payload": "file it"}, key="t")
    (op,) = await ledger.backend.operations(run.id)
    expected = {"id": op.id, "tool": "upload", "value": "file it"}
    assert first == (expected if plain.era == "2026" else Cause.TRANSPORT)
    assert retried == expected
    assert len(await plain.effects_of(op.id)) == 1
