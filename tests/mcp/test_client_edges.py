"""The gated MCP client at its edges: what a cut sent, a transport that breaks under
a call, a re-issue, and tool hints from a server we cannot check.

Real servers over real transports: the third-party-style server (it knows
nothing of stopline), ``@modelcontextprotocol/server-everything`` (a server we
did not write) and small MCP SDK servers written here, each with a ground-truth
log of the effects it really made.
"""

from __future__ import annotations

import contextlib
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from mcp import StdioServerParameters
from stopline import CancelState, OpStatus, PhaseKind, Policy
from stopline.domain.vocab import Cause
from stopline.integrations.mcp import StoplineMCP, ToolPolicy
from tests.conftest import FAST_VERIFY
from tests.mcp.conftest import ROOT, server_env
from tests.support.thirdparty_mcp_server import commits, http_server, stdio_params
from tests.support.truth_matrix import ctl

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- item: a cancel the cut sent is "asked" (R14) ----------------------------------------


@contextlib.contextmanager
def thirdparty(transport: str, log: Path) -> Iterator[tuple[Any, str]]:
    """The third-party-style server over ``transport``: its target and client mode."""
    kind, mode = transport.split("-", 1)
    mode = "legacy" if mode == "legacy" else "2026-07-28"
    if kind == "stdio":
        yield stdio_params(log), mode
    else:
        with http_server(log) as url:
            yield url, mode


@pytest.mark.parametrize("transport", ["stdio-legacy", "http-legacy", "http-2026"])
async def test_r14_a_cut_that_sent_the_cancel_records_it_asked_not_not_asked(
    tmp_path: Path, transport: str
) -> None:
    """Under ``immediate`` the cut ends the call, and the SDK sends the cancel as it
    unwinds; the canceller, asked after, found no call and answered ``not_asked``."""
    log = tmp_path / "truth.jsonl"
    policies = {"pay_late": ToolPolicy(key_argument="idempotency_key", settles_within=1.0)}
    run_id, key = "cut-asked", "cut-asked/pay"
    with thirdparty(transport, log) as (target, mode):
        async with (
            stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
            StoplineMCP(target, mode=mode, name="pay", policies=policies) as conn,
        ):
            await ctl(conn.client, "ctl_hold", tool="pay_late", at="50", idempotency_key=key)

            async def workflow() -> None:
                async with (
                    ledger.run("pay", owner="user:1", run_id=run_id) as run,
                    run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),
                ):
                    await conn.call(run, "pay_late", {"amount": 5}, key="pay")

            async with anyio.create_task_group() as tg:
                tg.start_soon(workflow)
                await ctl(conn.client, "ctl_reached", tool="pay_late", at="50", idempotency_key=key)
                await ledger.cancel(run_id, by="user:1")  # immediate: the call is cut
                await ctl(conn.client, "ctl_release", tool="pay_late", at="50", idempotency_key=key)
            receipt = await ledger.wait_settled(run_id, timeout=60)
            op = (await ledger.backend.operations(run_id))[0]
            events = [e for e in await ledger.backend.events(run_id) if e.op_id == op.id]
    kinds = [e.kind for e in events]
    asked = [e.data for e in events if e.kind == "cancel_asked"]
    channel = "stream_close" if transport == "http-2026" else "notifications/cancelled"
    assert [a["channel"] for a in asked] == [channel]
    assert "cancel_not_asked" not in kinds
    assert op.cancel_state is CancelState.ASKED
    assert "cancel asked" in receipt.text()
    assert len(commits(log, key)) <= 1


async def test_r14_a_cut_call_at_server_everything_is_recorded_asked(tmp_path: Path) -> None:
    """The same against a server we did not write: its long-running operation."""
    tool = "trigger-long-running-operation"
    target = StdioServerParameters(
        command="npx", args=["-y", "@modelcontextprotocol/server-everything", "stdio"]
    )
    policies = {tool: ToolPolicy(effects=True, settles_within=0.5)}
    sent = anyio.Event()
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        StoplineMCP(target, name="everything", policies=policies) as conn,
    ):
        conn.on_request = lambda key, request_id: sent.set()

        async def workflow() -> None:
            async with (
                ledger.run("long", owner="user:1", run_id="everything") as run,
                run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),
            ):
                await conn.call(run, tool, {"duration": 30, "steps": 30})

        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow)
            await sent.wait()  # the request is written: the cut makes the SDK cancel it
            await ledger.cancel("everything", by="user:1")
        receipt = await ledger.wait_settled("everything", timeout=60)
        op = (await ledger.backend.operations("everything"))[0]
        kinds = [e.kind for e in await ledger.backend.events("everything")]
    assert "cancel_asked" in kinds and "cancel_not_asked" not in kinds
    assert op.cancel_state is CancelState.ASKED
    assert "cancel asked" in receipt.text()


# -- small SDK servers with a ground truth ---------------------------------------------

_SERVER = '''
import json, os, sys
from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

LOG = sys.argv[1]
server = MCPServer("edges")


def effect(tool, key):
    with open(LOG, "a") as f:
        f.write(json.dumps({"tool": tool, "key": key}) + "\\n")
        f.flush()
        os.fsync(f.fileno())


def seen(tool, key):
    try:
        with open(LOG) as f:
            return any(json.loads(l) == {"tool": tool, "key": key} for l in f)
    except FileNotFoundError:
        return False


@server.tool(annotations=ToolAnnotations(idempotent_hint=True))
async def hinted(key: str) -> str:
    """Says idempotentHint, does not dedupe: commits, then its process ends unanswered."""
    effect("hinted", key)
    sys.stdout.flush()
    os._exit(3)


@server.tool()
async def keyed(idempotency_key: str) -> str:
    """Dedupes by its key; the first attempt commits, then its process ends unanswered."""
    if seen("keyed", idempotency_key):
        return "done"
    effect("keyed", idempotency_key)
    os._exit(3)


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def liar(key: str) -> str:
    """Says readOnlyHint, and writes."""
    effect("liar", key)
    return "read"


server.run("stdio")
'''

_RAW = """
import json, sys

def send(obj):
    sys.stdout.buffer.write(json.dumps(obj).encode() + b"\\n")
    sys.stdout.buffer.flush()

for line in sys.stdin:
    msg = json.loads(line)
    method, mid = msg.get("method"), msg.get("id")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {
            "protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
            "serverInfo": {"name": "raw", "version": "1"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": mid, "result": {"tools": [
            {"name": "garbage", "inputSchema": {"type": "object"}}]}})
    elif method == "tools/call":
        with open(sys.argv[1], "a") as f:
            f.write(json.dumps({"tool": "garbage"}) + "\\n")
        sys.stdout.buffer.write(b"\\xff\\xfe not UTF-8\\n")
        send({"jsonrpc": "2.0", "id": mid, "result": {
            "content": [{"type": "text", "text": "done"}], "isError": False}})
    elif mid is not None:
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
"""


def _server(tmp_path: Path, source: str, log: Path) -> StdioServerParameters:
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(source))
    return StdioServerParameters(
        command=sys.executable, args=[str(script), str(log)], cwd=str(ROOT), env=server_env()
    )


def _effects(log: Path, tool: str) -> int:
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text().splitlines() if json.loads(line)["tool"] == tool)


# -- item: a connection that ends ends its calls at once ---------------------------------


async def test_r3_bytes_that_are_not_utf8_end_the_call_at_once_as_transport(
    tmp_path: Path,
) -> None:
    """The SDK's reader fails on them and drains the pipe until the server ends: the
    call waited out the whole progress cap (300 s) and was called a timeout."""
    log = tmp_path / "truth.jsonl"
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        StoplineMCP(_server(tmp_path, _RAW, log), name="raw") as conn,
        ledger.run("garbage", owner="user:1") as run,
    ):
        with pytest.raises(stopline.NoAnswer) as lost:
            await conn.call(run, "garbage", {})
        op = (await ledger.backend.operations(run.id))[0]
    assert lost.value.cause is Cause.TRANSPORT
    assert "not UTF-8" in lost.value.detail
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)  # R3: never "not sent"
    assert op.cause is Cause.TRANSPORT
    assert _effects(log, "garbage") == 1


# -- item: a re-issue on 2026-07-28 ----------------------------------------------------


async def test_r5_an_idempotent_hint_alone_is_not_re_issued(tmp_path: Path) -> None:
    """A hint the client cannot check: re-sending on it made a second effect."""
    log = tmp_path / "truth.jsonl"
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        StoplineMCP(_server(tmp_path, _SERVER, log), mode="2026-07-28", name="e") as conn,
        ledger.run("hinted", owner="user:1") as run,
    ):
        with pytest.raises(stopline.NoAnswer):
            await conn.call(run, "hinted", {"key": "k"})
        kinds = [e.kind for e in await ledger.backend.events(run.id)]
    assert "mcp_reissued" not in kinds
    assert _effects(log, "hinted") == 1


async def test_r8_a_re_issued_call_says_so_on_its_receipt_line(tmp_path: Path) -> None:
    """The key survives the re-issue (``key_argument``): sent twice, one effect, and the
    receipt line's evidence says that a second request was sent."""
    log = tmp_path / "truth.jsonl"
    policies = {"keyed": ToolPolicy(key_argument="idempotency_key")}
    target = _server(tmp_path, _SERVER, log)
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        StoplineMCP(target, mode="2026-07-28", name="e", policies=policies) as conn,
        ledger.run("keyed", owner="user:1") as run,
    ):
        assert await conn.call(run, "keyed", {}) == {"result": "done"}
        receipt = await run.receipt()
        kinds = [e.kind for e in await ledger.backend.events(run.id)]
    assert kinds.count("mcp_reissued") == 1
    assert _effects(log, "keyed") == 1
    (line,) = receipt.lines
    assert line.status is OpStatus.COMMITTED
    assert "sent_twice" in line.text()


# -- item: readOnlyHint from a server we cannot check (ADR 0055) ------------------------


async def test_r1_a_read_only_hint_alone_does_not_bypass_the_gate(tmp_path: Path) -> None:
    """By default the hint is reported, not relied on: the tool is gated, its intent
    recorded before it is sent, and a fenced run's call is refused there."""
    log = tmp_path / "truth.jsonl"
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        StoplineMCP(_server(tmp_path, _SERVER, log), name="e") as conn,
    ):
        assert conn.tool("liar").effects is True
        async with ledger.run("liar", owner="user:1") as run:
            assert await conn.call(run, "liar", {"key": "a"}) == {"result": "read"}
            ops = await ledger.backend.operations(run.id)
        assert [(o.tool, o.status) for o in ops] == [("e/liar", OpStatus.COMMITTED)]
        async with ledger.run("fenced", owner="user:1") as fenced:
            await ledger.cancel(fenced.id, by="user:1")
            with pytest.raises(stopline.RunFenced):
                await conn.call(fenced, "liar", {"key": "b"})
    assert _effects(log, "liar") == 1  # the fenced run's call never reached the server


async def test_a_read_only_hint_is_a_read_only_when_trusted(tmp_path: Path) -> None:
    log = tmp_path / "truth.jsonl"
    target = _server(tmp_path, _SERVER, log)
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        StoplineMCP(target, name="e", trust_read_hints=True) as conn,
        ledger.run("trusted", owner="user:1") as run,
    ):
        assert conn.tool("liar").effects is False
        assert await conn.call(run, "liar", {"key": "a"}) == {"result": "read"}
        assert await ledger.backend.operations(run.id) == []
