"""An MCP server that dies, crash-loops and comes back: bounded calls, backoff, no loss."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

import stopline
from mcp import MCPError, StdioServerParameters
from stopline import OpStatus
from stopline.integrations.mcp import StoplineMCP
from stopline.runtime.tool import NoAnswer
from tests.conftest import FAST_VERIFY
from tests.mcp.conftest import ROOT, server_env

pytestmark = pytest.mark.timeout(60)


class Flaky:
    """The testing server behind a launcher that crash-loops while ``crashing``."""

    def __init__(self, tmp: Path) -> None:
        self.flag = tmp / "crash"
        self.count = tmp / "launches"
        self.count.touch()
        self.params = StdioServerParameters(
            command=sys.executable,
            args=[
                "-m",
                "tests.faults.crashloop",
                str(self.flag),
                str(self.count),
                "--db",
                str(tmp / "effects.db"),
            ],
            cwd=str(ROOT),
            env=server_env(),
        )

    @property
    def launches(self) -> int:
        return len(self.count.read_text().splitlines())

    def crash_loop(self, on: bool) -> None:
        if on:
            self.flag.touch()
        else:
            self.flag.unlink(missing_ok=True)


@pytest.fixture
async def flaky(tmp_path: Path) -> AsyncIterator[tuple[Flaky, StoplineMCP]]:
    server = Flaky(tmp_path)
    # a server process takes a while to start on a loaded machine: connecting may take long
    # its lookup is a read by its readOnlyHint: this server is ours, its hints trusted
    async with StoplineMCP(
        server.params, name="flaky", connect_timeout=30.0, trust_read_hints=True
    ) as mcp:
        yield server, mcp


async def kill(mcp: StoplineMCP) -> None:
    with pytest.raises(MCPError):
        await mcp.client.call_tool("ctl_die", {})


async def test_a_crash_looping_server_is_relaunched_with_backoff(
    tmp_path: Path, flaky: tuple[Flaky, StoplineMCP]
) -> None:
    server, mcp = flaky
    async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        async with ledger.run("job", owner="u", run_id="run_1") as run:
            assert await mcp.call(run, "lookup", {"key": "k"}) == {"effects": []}
            server.crash_loop(True)
            await kill(mcp)
            before = server.launches
            with pytest.raises((NoAnswer, TimeoutError)):  # bounded by its deadline
                await mcp.call(run, "lookup", {"key": "k"}, idle_timeout=2.0)
            with pytest.raises(stopline.Rejected, match="not sent"):  # never left: not committed
                await mcp.call(run, "echo", {"payload": "p"}, key="while_down", idle_timeout=1.0)
            relaunched = server.launches - before
            server.crash_loop(False)
            # the fault clears: the read re-opens the connection and the work goes on
            assert await mcp.call(run, "lookup", {"key": "k"}, idle_timeout=30.0) == {"effects": []}
            assert await mcp.call(run, "echo", {"payload": "p"}, key="after", idle_timeout=30.0)
        ops = {op.id: op.status for op in await ledger.backend.operations("run_1")}
        receipt = await ledger.receipt("run_1")
    assert relaunched <= 12  # capped exponential backoff, not ~110 launches a second
    assert ops == {"run_1/while_down": OpStatus.NOT_COMMITTED, "run_1/after": OpStatus.COMMITTED}
    assert receipt.run_state.value == "completed"


async def test_reads_reopen_the_connection_after_a_crash(
    tmp_path: Path, flaky: tuple[Flaky, StoplineMCP]
) -> None:
    server, mcp = flaky
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger,
        ledger.run("job", owner="u") as run,
    ):
        for _ in range(3):
            await kill(mcp)  # the server dies; nobody calls an effect in between
            assert await mcp.call(run, "lookup", {"key": "k"}, idle_timeout=30.0) == {"effects": []}
    assert mcp.connections == 4 and server.launches == 4


async def test_every_verifier_error_is_kept_as_evidence(
    tmp_path: Path, flaky: tuple[Flaky, StoplineMCP]
) -> None:
    server, mcp = flaky
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with stopline.open(url, verify=FAST_VERIFY) as ledger:
        async with ledger.run("job", owner="u", run_id="run_1") as run:
            await mcp.client.call_tool("ctl_fault", {"tool": "upload", "fault": "die"})
            server.crash_loop(True)  # it commits, dies, and cannot come back for now
            with pytest.raises(NoAnswer):
                await mcp.call(run, "upload", {"payload": "x"}, key="up", idle_timeout=30.0)
        mcp.connect_timeout = 1.0  # a verifier's look gives up soon while it is down
        op = await ledger.verify("run_1/up")
        assert op.status is OpStatus.UNKNOWN
        server.crash_loop(False)
        mcp.connect_timeout = 30.0
        with anyio.fail_after(30):
            op = await ledger.verify("run_1/up")  # the server is back: it committed
        events = await ledger.backend.events("run_1")
    assert op.status is OpStatus.COMMITTED
    unknown = [e for e in events if e.kind == "verify_unknown"]
    assert unknown and "unreachable" in str(unknown[0].data)
