"""A connection that cannot be opened raises ``NoAnswer`` naming its server (ADR 0117).

Real servers, each failing the opening its own way: the TypeScript reference server
``server-everything`` (2025-11-25 only) opened with ``mode="2026-07-28"``, whose tool
listing the SDK cannot read; a stdio command that does not exist; a Python process
that exits at once; a URL at which nothing listens. Each raised the SDK's error as it
came (an ``ExceptionGroup``, a ``FileNotFoundError``), no stopline error. Each now leaves
no child process running and nothing in the ledger.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import stopline
from mcp import StdioServerParameters
from stopline import Cause
from stopline.errors import NoAnswer
from stopline.integrations.mcp import StoplineMCP
from stopline.integrations.mcp.check_report import Exit

NODE = shutil.which("node")
EVERYTHING = (
    Path(__file__).resolve().parent
    / "node"
    / "node_modules"
    / "@modelcontextprotocol"
    / "server-everything"
    / "dist"
    / "index.js"
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def children() -> set[int]:
    """The processes this one started that are still there (zombies too: not reaped)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue  # it ended while we looked
        if f"\nPPid:\t{os.getpid()}\n" in status:
            found.add(int(entry.name))
    return found


async def refused_open(
    tmp_path: Path, target: StdioServerParameters | str, mode: str = "legacy"
) -> NoAnswer:
    """Opening ``target`` inside a run: the error it raised, after checking that no
    child process is left and that the ledger holds no operation."""
    before = children()
    async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        async with ledger.run("job", owner="u", run_id="run_1"):
            with anyio.fail_after(45), pytest.raises(NoAnswer) as raised:
                async with StoplineMCP(target, mode=mode, name="broken", connect_timeout=40):
                    pytest.fail("it opened")
        assert await ledger.backend.operations("run_1") == []
    assert children() <= before  # the server's process ended with the failed opening
    assert "'broken'" in str(raised.value)  # the server is named
    return raised.value


@pytest.mark.skipif(NODE is None, reason="the TypeScript reference servers need node")
async def test_a_2025_server_opened_in_2026_mode_says_so(tmp_path: Path) -> None:
    assert NODE is not None and EVERYTHING.exists(), "run `make tests/mcp/node/node_modules`"
    target = StdioServerParameters(command=NODE, args=[str(EVERYTHING), "stdio"])
    error = await refused_open(tmp_path, target, mode="2026-07-28")
    assert error.cause is Cause.SERVER_ERROR
    assert "does not speak 2026-07-28" in error.detail
    assert "ListToolsResult" in error.detail and "resultType" in error.detail
    assert 'mode="legacy" or mode="auto" opens it' in error.detail
    assert str(EVERYTHING) in error.detail  # which server: its command
    with anyio.fail_after(45):  # and it does: the advice holds
        async with StoplineMCP(target, mode="auto", connect_timeout=40) as mcp:
            assert "echo" in mcp.listing


@pytest.mark.skipif(NODE is None, reason="the TypeScript reference servers need node")
def test_check_mcp_in_2026_era_of_a_2025_server_says_which_era_opens_it() -> None:
    """``stopline check-mcp --era 2026-07-28`` of that server keeps its own advice in the
    CLI's terms (its read of the error looked into exception groups only, and missed
    the ``ValidationError`` under the typed ``NoAnswer``)."""
    assert NODE is not None and EVERYTHING.exists(), "run `make tests/mcp/node/node_modules`"
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "stopline.cli", "check-mcp", "--era", "2026-07-28"]
    out = subprocess.run(
        [*command, "--", NODE, str(EVERYTHING), "stdio"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root / "src")},
        cwd=root,
        timeout=50,
        check=False,
    )
    assert out.returncode == Exit.ERROR, out.stderr  # an error, not findings
    assert "do not fit the 2026-07-28 protocol: pass --era legacy" in out.stderr


async def test_a_command_that_does_not_exist(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-server")
    error = await refused_open(tmp_path, StdioServerParameters(command=missing))
    assert error.cause is Cause.TRANSPORT
    assert "FileNotFoundError" in error.detail and missing in error.detail
    assert isinstance(error.__cause__, FileNotFoundError)


async def test_a_server_that_exits_at_once(tmp_path: Path) -> None:
    target = StdioServerParameters(command=sys.executable, args=["-c", "raise SystemExit(3)"])
    error = await refused_open(tmp_path, target)
    assert error.cause is Cause.TRANSPORT
    assert "could not be opened" in error.detail and "Connection closed" in error.detail


@pytest.fixture
def deaf_url() -> Iterator[str]:
    """A port bound and never listened on: every connection to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"


async def test_a_url_nobody_listens_at(tmp_path: Path, deaf_url: str) -> None:
    error = await refused_open(tmp_path, deaf_url)
    assert error.cause is Cause.TRANSPORT
    assert deaf_url in error.detail and "ConnectError" in error.detail
