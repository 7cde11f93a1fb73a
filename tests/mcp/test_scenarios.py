"""CONTRACT.md scenarios S2, S3, S10, S12, S15 over a real MCP server, on stdio and
Streamable HTTP, in both protocol eras. The server holds each call at a barrier
the test controls through the server's own control tools: no sleeps."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import pytest

import stopline
from stopline import Cause, Headline, OpStatus, PhaseKind, Policy
from stopline.integrations.mcp import StoplineMCP
from tests.mcp.conftest import TRANSPORTS, Server, open_server, wait_status
from tests.scenarios.workflows import Started, start

pytestmark = pytest.mark.timeout(30)
Body = Callable[[stopline.Run, Started], Awaitable[None]]


@pytest.fixture(scope="module", params=TRANSPORTS)
async def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Server]:
    transport = str(request.param)
    http = request.getfixturevalue("http_url") if transport.startswith("http") else None
    async for opened in open_server(transport, tmp_path_factory.mktemp("srv"), http):
        yield opened


def calling(
    conn: StoplineMCP, tool: str, policy: Policy | None = None, payload: str = "report"
) -> Body:
    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, policy):
            started.results.append(await conn.call(run, tool, {"payload": payload}))

    return body


async def only_op(ledger: stopline.Ledger, run_id: str) -> stopline.OperationRecord:
    ops = await ledger.backend.operations(run_id)
    assert len(ops) == 1
    return ops[0]


async def test_s02_mcp_cancel_while_waiting_confirmed(
    ledger: stopline.Ledger, server: Server
) -> None:
    """The server's own record confirms the cancel: not_committed, nothing done."""
    await server.hold("received:upload")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calling(server.conn, "upload"))
        key = await server.reached("received:upload")
        await ledger.cancel(started.run_id, by="user:1")
    receipt = await ledger.wait_settled(started.run_id, timeout=20)
    op = await only_op(ledger, started.run_id)
    assert op.id == key
    assert op.status is OpStatus.NOT_COMMITTED
    assert op.cancel_state == "confirmed"
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert await server.effects_of(key) == []
    log = await server.cancellations_of(key)  # the server-side signal: who, when, in what state
    assert {"tool_stopped"} <= {c["via"] for c in log}
    assert all(c["at"] > 0 and c["tool"] == "upload" for c in log)
    assert any(c["state"] == "received" for c in log)  # the state at the moment of the cancel


async def test_s03_mcp_cancel_after_commit_before_response(
    ledger: stopline.Ledger, server: Server
) -> None:
    """Immediate policy: the SDK sends the cancel; unknown, then verified committed."""
    await server.hold("committed:notify")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calling(server.conn, "notify", Policy.IMMEDIATE))
        key = await server.reached("committed:notify")
        await ledger.cancel(started.run_id, by="user:1")
    receipt = await ledger.wait_settled(started.run_id, timeout=20)
    await server.release("committed:notify")
    op = await only_op(ledger, started.run_id)
    assert op.status is OpStatus.COMMITTED
    assert op.cause is Cause.USER_CANCEL
    kinds = [e.kind for e in await ledger.backend.events(started.run_id) if e.op_id == op.id]
    assert kinds.index("lost") < kinds.index("verified_committed")
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert len(await server.effects_of(key)) == 1


async def test_s10_mcp_provider_refuses_the_cancel(ledger: stopline.Ledger, server: Server) -> None:
    """Awaiting confirmation while the server goes on; then the real outcome."""
    await server.hold("accepted:deploy")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calling(server.conn, "deploy"))
        key = await server.reached("accepted:deploy")
        await wait_status(ledger, key, OpStatus.ACCEPTED)
        at_cancel = await ledger.cancel(started.run_id, by="user:1")
        assert at_cancel.headline is Headline.AWAITING_CONFIRMATION
        if server.transport != "http-2026":  # a 2026 HTTP cancel is a stream close, seen later
            while (await ledger.backend.get_operation(key)).cancel_state != "refused":
                await ledger.wait_for_change(started.run_id)
            refused = await ledger.receipt(started.run_id)
            assert refused.headline is Headline.AWAITING_CONFIRMATION
            assert "refused to cancel" in refused.lines[0].provider_cancel
        await server.release("accepted:deploy")
    receipt = await ledger.wait_settled(started.run_id, timeout=20)
    assert receipt.lines[0].status is OpStatus.COMMITTED
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert len(await server.effects_of(key)) == 1


async def test_s12_mcp_two_runs_share_one_connection(
    ledger: stopline.Ledger, server: Server
) -> None:
    """Cancelling one run leaves the other's call running to completion; the connection stays."""
    connections = server.conn.connections
    await server.hold("received:upload")
    await server.hold("accepted:notify")
    async with anyio.create_task_group() as tg:
        mine = start(tg, ledger, calling(server.conn, "upload", Policy.IMMEDIATE))
        mine_key = await server.reached("received:upload")
        other = start(tg, ledger, calling(server.conn, "notify"), owner="user:2")
        other_key = await server.reached("accepted:notify")
        await ledger.cancel(mine.run_id, by="user:1")
        await mine.done.wait()
        await server.release("accepted:notify")
    mine_receipt = await ledger.wait_settled(mine.run_id, timeout=20)
    other_receipt = await ledger.wait_settled(other.run_id, timeout=20)
    assert mine_receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert other_receipt.headline is Headline.COMPLETED
    assert other.results == [{"id": other_key, "tool": "notify", "value": "report"}]
    assert await server.effects_of(mine_key) == []
    assert server.conn.connections == connections  # the shared connection was never closed
    assert await server.ctl("lookup", key=other_key) == {
        "effects": await server.effects_of(other_key)
    }


async def test_s15_mcp_cannot_cancel_once_accepted(ledger: stopline.Ledger, server: Server) -> None:
    """The limitation is on that operation's receipt line while it is in flight."""
    await server.hold("accepted:upload")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calling(server.conn, "upload"))
        key = await server.reached("accepted:upload")
        await wait_status(ledger, key, OpStatus.ACCEPTED)
        line = (await ledger.receipt(started.run_id)).lines[0]
        assert line.provider_cancel == "the provider cannot cancel it once accepted"
        at_cancel = await ledger.cancel(started.run_id, by="user:1")
        assert at_cancel.lines[0].provider_cancel == "the provider cannot cancel it once accepted"
        assert at_cancel.lines[0].status is OpStatus.ACCEPTED
        await server.release("accepted:upload")
    receipt = await ledger.wait_settled(started.run_id, timeout=20)
    assert receipt.lines[0].status is OpStatus.COMMITTED
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_mcp_progress_is_recorded_never_a_commit(
    ledger: stopline.Ledger, server: Server
) -> None:
    async with ledger.run("work", owner="user:1") as run:
        result = await server.conn.call(run, "work", {"payload": "p", "steps": 3}, idle_timeout=30)
    op = await only_op(ledger, run.id)
    events = [e for e in await ledger.backend.events(run.id) if e.op_id == op.id]
    progress = [e.data["message"] for e in events if e.kind == "progress"]
    assert sorted(progress) == ["step 1/3", "step 2/3", "step 3/3"]
    assert [e.kind for e in events].index("committed") > 0
    assert result == {"id": op.id, "tool": "work", "value": "p"}


async def test_mcp_tool_metadata_sets_policy(server: Server, tmp_path: Path) -> None:
    conn = server.conn
    assert conn.tool("upload").cancellable is stopline.Cancellable.UNTIL_ACCEPTED
    assert conn.tool("notify").cancellable is stopline.Cancellable.NEVER
    assert conn.tool("notify").cancel_fn is None  # nothing to ask
    assert conn.tool("deploy").cancellable is stopline.Cancellable.AFTER_ACCEPTED
    assert conn.tool("lookup").effects is False  # declared a read in stopline's _meta
    assert conn.tool("upload").verify_fn is not None  # the server offers stopline_verify
