"""The client against what a real server does to a connection and a listing: a
Streamable HTTP session the server no longer has (404), a body over its limit (413),
a tool listed twice with conflicting declarations, and the documented verifier
recipe after the connection was lost.

Real servers we did not write the transport of: the third-party-style server (the
official SDK's ``MCPServer``, knowing nothing of stopline) over real stdio and real
Streamable HTTP (uvicorn), and a small SDK server written here that lists one tool
twice. Each keeps a ground-truth log of the effects it really made. Barriers, no
sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from mcp import StdioServerParameters
from stopline import Cancellable, OpStatus
from stopline.integrations.mcp import StoplineMCP, ToolPolicy
from tests.conftest import FAST_VERIFY
from tests.mcp.conftest import ROOT, server_env
from tests.support.thirdparty_mcp_server import commits, http_server, stdio_params
from tests.support.truth_matrix import ctl

pytestmark = pytest.mark.timeout(90)

THIRDPARTY = ROOT / "tests" / "support" / "thirdparty_mcp_server.py"
PAY = "pay_cancellable"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def refs(op: stopline.OperationRecord) -> list[str]:
    return [e.ref for e in op.evidence]


# -- a session the server no longer has (HTTP 404) -----------------------------------------


class Restartable:
    """The third-party server over Streamable HTTP on a socket this test holds, so a
    restart (a new process, no sessions) serves the same URL with no start-up race."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/mcp"
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        fd = self.sock.fileno()
        args = [sys.executable, str(THIRDPARTY), "--log", str(self.log), "--fd", str(fd)]
        return subprocess.Popen(args, pass_fds=[fd], stderr=subprocess.DEVNULL)

    def restart(self) -> None:
        """Killed and started again: every session it had is gone."""
        self.proc.kill()
        self.proc.wait(10)
        self.proc = self._start()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self.sock.close()


@contextlib.contextmanager
def restartable(log: Path) -> Iterator[Restartable]:
    server = Restartable(log)
    try:
        yield server
    finally:
        server.close()


async def test_a_session_the_server_lost_is_not_processed_and_the_connection_reopens(
    tmp_path: Path,
) -> None:
    """The server restarted while idle: the next call's POST carries the old session id
    and gets 404. The specification: that request was not processed, start a new
    session. The call is ``not_committed`` (the 404 its evidence) and the next call
    opens a new session and commits once. Before: every later call was ``unknown``
    (server_error -32600) and went to review; the connection never re-opened."""
    log = tmp_path / "truth.jsonl"
    policies = {PAY: ToolPolicy(key_argument="idempotency_key")}
    with restartable(log) as server:
        async with (
            stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
            StoplineMCP(server.url, mode="legacy", name="pay", policies=policies) as conn,
            ledger.run("session", owner="user:1") as run,
        ):
            await conn.call(run, PAY, {"amount": 1})
            server.restart()
            with pytest.raises(stopline.Rejected) as refused:
                await conn.call(run, PAY, {"amount": 2})
            await conn.call(run, PAY, {"amount": 3})
            ops = await ledger.backend.operations(run.id)
            receipt = await run.receipt()
        opened = conn.connections
    assert "HTTP 404" in refused.value.reason
    committed, refused_status = OpStatus.COMMITTED, OpStatus.NOT_COMMITTED
    assert [o.status for o in ops] == [committed, refused_status, committed]
    assert [line.status for line in receipt.lines] == [o.status for o in ops]
    assert any(r.startswith("http_404:") for r in refs(ops[1]))
    assert opened == 2  # re-opened once, for the call after the refused one
    # each effect once, the refused call's none: nothing repeated, nothing ungated
    assert [c["key"] for c in commits(log)] == [ops[0].id, ops[2].id]


# -- a body over the server's limit (HTTP 413) ----------------------------------------------


async def test_a_request_over_the_servers_size_limit_is_not_processed(tmp_path: Path) -> None:
    """The SDK server refuses a body over 4 MiB with 413 before reading it as a request.
    Before: ``unknown`` (server_error -32603, the status lost) and review."""
    log = tmp_path / "truth.jsonl"
    policies = {PAY: ToolPolicy(key_argument="idempotency_key")}
    with http_server(log) as url:
        async with (
            stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
            StoplineMCP(url, mode="legacy", name="pay", policies=policies) as conn,
            ledger.run("huge", owner="user:1") as run,
        ):
            with pytest.raises(stopline.Rejected) as refused:
                await conn.call(run, PAY, {"amount": 1, "memo": "x" * (5 << 20)})
            await conn.call(run, PAY, {"amount": 2})  # the connection is fine
            ops = await ledger.backend.operations(run.id)
            receipt = await run.receipt()
        opened = conn.connections
    assert "HTTP 413" in refused.value.reason
    assert [o.status for o in ops] == [OpStatus.NOT_COMMITTED, OpStatus.COMMITTED]
    assert receipt.lines[0].status is OpStatus.NOT_COMMITTED
    assert any(r.startswith("http_413:") for r in refs(ops[0]))
    assert opened == 1
    assert [c["key"] for c in commits(log)] == [ops[1].id]


# -- one tool name listed twice --------------------------------------------------------------

_TWICE = '''
import json, os, sys
from mcp.server.mcpserver import MCPServer

LOG, ORDER = sys.argv[1], sys.argv[2]
EFFECTFUL = {"io.stopline/effects": True, "io.stopline/cancellable": "never"}


class Twice(MCPServer):
    """Lists ``pay`` twice: once effectful and not cancellable, once as a read."""

    async def list_tools(self):
        tools = [t for t in await super().list_tools() if t.name != "pay"]
        pay = next(t for t in await super().list_tools() if t.name == "pay")
        loud = pay.model_copy(update={"meta": EFFECTFUL})
        quiet = pay.model_copy(update={"meta": {"io.stopline/effects": False}})
        return [*tools, *((loud, quiet) if ORDER == "effectful-first" else (quiet, loud))]


server = Twice("twice")


@server.tool()
async def pay(idempotency_key: str = "") -> str:
    with open(LOG, "a") as f:
        f.write(json.dumps({"tool": "pay", "key": idempotency_key}) + "\\n")
        f.flush()
        os.fsync(f.fileno())
    return "paid"


server.run("stdio")
'''


def _twice(tmp_path: Path, log: Path, order: str) -> StdioServerParameters:
    script = tmp_path / "twice.py"
    script.write_text(textwrap.dedent(_TWICE))
    args = [str(script), str(log), order]
    return StdioServerParameters(command=sys.executable, args=args, cwd=str(ROOT), env=server_env())


def _effects(log: Path) -> list[str]:
    if not log.exists():
        return []
    return [json.loads(line)["key"] for line in log.read_text().splitlines()]


@pytest.mark.parametrize("order", ["effectful-first", "read-first"])
async def test_r1_a_tool_listed_twice_keeps_its_most_conservative_declaration(
    tmp_path: Path, order: str
) -> None:
    """Which copy the server runs is unknown: neither may weaken the gate. Before, the
    last copy won: ``effects: false`` made the payment an ungated read, sent from a
    paused run with no intent and no key, committed, with no receipt line."""
    log = tmp_path / "truth.jsonl"
    policies = {"pay": ToolPolicy(key_argument="idempotency_key")}
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        StoplineMCP(_twice(tmp_path, log, order), name="twice", policies=policies) as conn,
    ):
        policy = conn.policy("pay")
        assert (policy.effects, policy.cancellable) == (True, Cancellable.NEVER)
        assert conn.tool("pay").effects is True
        refused: list[BaseException] = []
        async with ledger.run("paused", owner="user:1") as paused:
            await ledger.pause(paused.id, by="user:1")

            async def call_paused() -> None:  # waits at the gate: no send while paused
                try:
                    await conn.call(paused, "pay", {})
                except stopline.RunFenced as exc:
                    refused.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(call_paused)
                await ledger.cancel(paused.id, by="user:1")  # the gate then refuses it
        assert len(refused) == 1
        assert _effects(log) == []  # the paused run's call never reached the server
        async with ledger.run("running", owner="user:1") as run:
            assert await conn.call(run, "pay", {}) == {"result": "paid"}
            ops = await ledger.backend.operations(run.id)
            receipt = await run.receipt()
    assert [(o.tool, o.status) for o in ops] == [("twice/pay", OpStatus.COMMITTED)]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert _effects(log) == [ops[0].id]  # gated: sent once, with the operation's key


# -- the documented verifier recipe after a lost connection ----------------------------------


def find_payment_verifier(conn: StoplineMCP) -> Any:
    """docs/mcp.md's recipe, as written there."""

    async def verify(ctx: stopline.CallContext) -> stopline.ReadBack:
        result = await conn.client.call_tool("find_payment", {"idempotency_key": ctx.key})
        if result.is_error or not isinstance(result.structured_content, dict):
            return stopline.ReadBack(stopline.Verdict.UNKNOWN, detail="lookup failed")
        if result.structured_content["found"]:
            payment = result.structured_content["payment"]
            return stopline.ReadBack(stopline.Verdict.COMMITTED, ref=ctx.key, result=payment)
        return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, ref=ctx.key)

    return verify


def _server_pid(log: Path) -> int:
    """The stdio server process the client started for ``log`` (a child of this one)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
            ppid = next(int(x.split()[1]) for x in status.splitlines() if x.startswith("PPid:"))
            if str(log).encode() in cmdline and ppid == os.getpid():
                return int(entry.name)
    raise AssertionError(f"no server process for {log}")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the server's pid in /proc")
async def test_the_documented_verifier_reads_back_after_the_connection_was_lost(
    tmp_path: Path,
) -> None:
    """The server is killed while it holds the call before its commit: the call is
    ``unknown`` (transport). The recipe's ``conn.client`` then found no connection
    (``RuntimeError``) at every read-back, the budget ran out and the call went to
    review, though the server's record proves nothing was committed. A verifier now
    runs on the connection re-opened; the call settles ``not_committed``."""
    log = tmp_path / "truth.jsonl"
    policies = {PAY: ToolPolicy(key_argument="idempotency_key", settles_within=0.5)}
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        StoplineMCP(stdio_params(log), mode="legacy", name="pay", policies=policies) as conn,
    ):
        conn.verifiers = {PAY: find_payment_verifier(conn)}
        lost: list[BaseException] = []
        async with ledger.run("killed", owner="user:1") as run:
            await ctl(conn.client, "ctl_hold", tool=PAY, at="50")

            async def call() -> None:
                try:
                    await conn.call(run, PAY, {"amount": 5})
                except stopline.NoAnswer as exc:
                    lost.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await ctl(conn.client, "ctl_reached", tool=PAY, at="50")
                os.kill(_server_pid(log), signal.SIGKILL)
        receipt = await ledger.wait_settled(run.id, timeout=60)
        (op,) = await ledger.backend.operations(run.id)
    assert len(lost) == 1  # the call itself could not know
    assert op.status is OpStatus.NOT_COMMITTED
    assert op.id in refs(op)  # the read-back's evidence: the lookup by its key
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED]
    assert commits(log) == []
