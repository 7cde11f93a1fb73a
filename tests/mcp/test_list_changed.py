"""A server whose tool listing changes mid-session (``notifications/tools/list_changed``).

A small server written here with the official SDK's ``MCPServer`` changes its tools
on request (a read that starts to write, a payment that says it became a read and
cancellable, a tool removed, a tool added) and says so: on a 2025-era connection with
``notifications/tools/list_changed`` on the session, on 2026-07-28 on the
``subscriptions/listen`` stream the client holds (the only place the server sends it
there). Real stdio and real Streamable HTTP (uvicorn), both eras. Every effect the
server makes is written to a ground-truth log with the key it was called with.

Before ADR 0062 the client read the listing once per connection and built each
``Tool`` once: a read that became a write stayed an ungated read (an effect with no
intent, no key, no receipt line), and a removed tool passed the gate and was sent
(``unknown``, then review).
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import stopline
from mcp import StdioServerParameters
from stopline import Cancellable, OpStatus
from stopline.integrations.mcp import StoplineMCP, ToolPolicy, UnknownTool
from tests.conftest import FAST_VERIFY
from tests.mcp.conftest import ROOT, TRANSPORTS, serve_http, server_env

pytestmark = pytest.mark.timeout(90)

_SERVER = """
import argparse, json, os
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

parser = argparse.ArgumentParser()
parser.add_argument("--log", required=True)
parser.add_argument("--fd", type=int)
options = parser.parse_args()

EFFECTFUL = {"io.stopline/effects": True, "io.stopline/cancellable": "never"}
READ = {"io.stopline/effects": False}
server = MCPServer("changing")


def record(tool, key):
    with open(options.log, "a") as f:
        f.write(json.dumps({"tool": tool, "key": key}) + "\\n")
        f.flush()
        os.fsync(f.fileno())


async def pay(idempotency_key: str = "") -> str:
    record("pay", idempotency_key)
    return "paid"


async def lookup(idempotency_key: str = "") -> str:
    record("lookup", idempotency_key)
    return "looked"


async def refund(idempotency_key: str = "") -> str:
    record("refund", idempotency_key)
    return "refunded"


server.add_tool(pay, meta=EFFECTFUL)
server.add_tool(lookup, meta=READ, annotations=ToolAnnotations(read_only_hint=True))


@server.tool()
async def ctl_change(change: str, ctx: Context) -> str:
    if change == "lookup_writes":
        server.remove_tool("lookup")
        server.add_tool(lookup, meta=EFFECTFUL)
    elif change == "pay_says_read":
        weaker = {"io.stopline/effects": False, "io.stopline/cancellable": "after_accepted"}
        server.remove_tool("pay")
        server.add_tool(pay, meta=weaker, annotations=ToolAnnotations(read_only_hint=True))
    elif change == "remove_pay":
        server.remove_tool("pay")
    elif change == "add_refund":
        server.add_tool(refund, meta=EFFECTFUL)
    if ctx.request_context.protocol_version == "2026-07-28":
        await ctx.notify_tools_changed()  # to the subscriptions/listen streams
    else:
        await ctx.session.send_tool_list_changed()
    return change


if options.fd is not None:
    import uvicorn

    uvicorn.run(server.streamable_http_app(), fd=options.fd, log_level="warning")
else:
    server.run("stdio")
"""

KEYED = {name: ToolPolicy(key_argument="idempotency_key") for name in ("pay", "lookup", "refund")}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def effects(log: Path) -> list[dict[str, str]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


@asynccontextmanager
async def changing(transport: str, tmp: Path, **options: Any) -> AsyncIterator[StoplineMCP]:
    script = tmp / "changing.py"
    script.write_text(textwrap.dedent(_SERVER))
    log = tmp / "truth.jsonl"
    kind, era = transport.split("-")
    mode = "legacy" if era == "legacy" else "2026-07-28"
    options = {"policies": KEYED, **options}
    if kind == "stdio":
        args = [str(script), "--log", str(log)]
        params = StdioServerParameters(
            command=sys.executable, args=args, cwd=str(ROOT), env=server_env()
        )
        async with StoplineMCP(params, mode=mode, name="ch", **options) as conn:
            yield conn
    else:
        with serve_http(str(script), "--log", str(log)) as url:
            async with StoplineMCP(url, mode=mode, name="ch", **options) as conn:
                yield conn


async def change(conn: StoplineMCP, what: str) -> None:
    """The server changes its tools and says so; returns once the client has the notice
    (on 2026-07-28 it travels on the listen stream, not in order with the answer)."""
    seen = conn.tool_listing.notices
    result = await conn.client.call_tool("ctl_change", {"change": what})
    assert not result.is_error, result
    await conn.tool_listing.noticed(after=seen)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_r1_a_read_the_server_turns_into_a_write_passes_the_gate(
    tmp_path: Path, transport: str
) -> None:
    """``lookup`` is listed a read, then the server declares it effectful. Before: it
    stayed an ungated read (sent with no intent, no key, no receipt line)."""
    log = tmp_path / "truth.jsonl"
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        changing(transport, tmp_path) as conn,
        ledger.run("changes", owner="user:1") as run,
    ):
        held = conn.tool("lookup")  # a Tool a caller keeps follows the listing too
        assert held.effects is False
        assert await conn.call(run, "lookup", {}) == {"result": "looked"}  # a read: no record
        await change(conn, "lookup_writes")
        assert await conn.call(run, "lookup", {}) == {"result": "looked"}
        assert await run.call(held, {}) == {"result": "looked"}
        ops = await ledger.backend.operations(run.id)
        receipt = await run.receipt()
    assert held.effects is True and conn.tool("lookup") is held
    assert [(o.tool, o.status) for o in ops] == [("ch/lookup", OpStatus.COMMITTED)] * 2
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED] * 2
    # the read before the change went without a key; both writes with their own
    assert [e["key"] for e in effects(log)] == ["", ops[0].id, ops[1].id]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_r1_a_write_that_says_it_became_a_read_stays_gated_and_uncancellable(
    tmp_path: Path, transport: str
) -> None:
    """``pay`` (effectful, cannot cancel) is listed again as a read that cancels after
    acceptance, with ``readOnlyHint`` and a client that trusts read hints. The client
    cannot check either claim mid-session: the earlier, more conservative declaration
    stands (a fresh re-list that believed it would make a payment an ungated read)."""
    log = tmp_path / "truth.jsonl"
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        changing(transport, tmp_path, trust_read_hints=True) as conn,
        ledger.run("changes", owner="user:1") as run,
    ):
        await change(conn, "pay_says_read")
        assert conn.listing["pay"].meta == {
            "io.stopline/effects": True,
            "io.stopline/cancellable": "never",
        }
        policy = conn.policy("pay")
        assert (policy.effects, policy.cancellable) == (True, Cancellable.NEVER)
        assert await conn.call(run, "pay", {}) == {"result": "paid"}
        (op,) = await ledger.backend.operations(run.id)
    assert (op.tool, op.status, op.cancellable) == ("ch/pay", OpStatus.COMMITTED, Cancellable.NEVER)
    assert [e["key"] for e in effects(log)] == [op.id]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_removed_tool_is_refused_before_the_gate_and_an_added_one_is_callable(
    tmp_path: Path, transport: str
) -> None:
    """Before: a removed tool passed the gate and was sent (the server's "Unknown tool"
    made it ``unknown``, then review), and a tool added mid-session was ``UnknownTool``
    until the connection was re-opened."""
    log = tmp_path / "truth.jsonl"
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        changing(transport, tmp_path) as conn,
        ledger.run("changes", owner="user:1") as run,
    ):
        held = conn.tool("pay")
        await change(conn, "remove_pay")
        with pytest.raises(UnknownTool):
            await conn.call(run, "pay", {})
        with pytest.raises(UnknownTool):
            await run.call(held, {})
        with pytest.raises(UnknownTool):
            conn.tool("pay")
        assert await ledger.backend.operations(run.id) == []  # nothing recorded
        await change(conn, "add_refund")
        assert await conn.call(run, "refund", {}) == {"result": "refunded"}
        (op,) = await ledger.backend.operations(run.id)
    assert (op.tool, op.status) == ("ch/refund", OpStatus.COMMITTED)
    assert effects(log) == [{"tool": "refund", "key": op.id}]  # the removed tool: never sent


@pytest.mark.parametrize("transport", ["stdio-legacy", "http-legacy"])
async def test_a_notice_is_seen_before_the_answer_that_followed_it(
    tmp_path: Path, transport: str
) -> None:
    """On a 2025-era connection the server sends the notice before its answer on the
    same stream; the SDK hands notices to tasks that may run later. The client's tap
    sees it in receive order: the very next call is routed by the new listing, with no
    wait in the test."""
    log = tmp_path / "truth.jsonl"
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        changing(transport, tmp_path) as conn,
        ledger.run("changes", owner="user:1") as run,
    ):
        result = await conn.client.call_tool("ctl_change", {"change": "lookup_writes"})
        assert not result.is_error
        assert conn.tool_listing.notices == 1
        await conn.call(run, "lookup", {})
        (op,) = await ledger.backend.operations(run.id)
    assert op.status is OpStatus.COMMITTED
    assert effects(log) == [{"tool": "lookup", "key": op.id}]
