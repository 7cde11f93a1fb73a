"""The io.modelcontextprotocol/tasks extension over a real server (stdio and HTTP,
2026-07-28; a legacy connection falls back to a plain call)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import pytest

import stopline
from stopline import Cause, OpStatus, PhaseKind, Policy
from stopline.integrations.mcp import ToolPolicy
from tests.mcp.conftest import Server, open_server, wait_status
from tests.scenarios.workflows import Started, start

pytestmark = pytest.mark.timeout(30)
Body = Callable[[stopline.Run, Started], Awaitable[None]]
TASKS = {"upload": ToolPolicy(task=True)}
# Tasks exist only on 2026-07-28 connections; on a legacy one the same policy falls back
# to a plain call (test_mcp_task_completes_and_commits covers that), so these run on 2026.
TASK_ERA = pytest.mark.parametrize("server", ["stdio-2026", "http-2026"], indirect=True)


@pytest.fixture(scope="module", params=["stdio-2026", "http-2026", "stdio-legacy"])
async def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Server]:
    transport = str(request.param)
    http = request.getfixturevalue("http_url") if transport.startswith("http") else None
    tmp = tmp_path_factory.mktemp("tasks")
    async for opened in open_server(transport, tmp, http, tasks=True, policies=TASKS):
        yield opened


def immediate(server: Server) -> Body:
    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
            started.results.append(await server.conn.call(run, "upload", {"payload": "t"}))

    return body


async def test_mcp_task_completes_and_commits(ledger: stopline.Ledger, server: Server) -> None:
    async with ledger.run("task", owner="user:1") as run:
        result = await server.conn.call(run, "upload", {"payload": "t"})
    op = (await ledger.backend.operations(run.id))[0]
    assert result == {"id": op.id, "tool": "upload", "value": "t"}
    assert op.status is OpStatus.COMMITTED
    refs = [e.ref for e in op.evidence]
    assert any(r.startswith("task:") for r in refs) == (server.era == "2026")


@TASK_ERA
async def test_mcp_task_cancel_is_a_request_then_the_truth(
    ledger: stopline.Ledger, server: Server
) -> None:
    """tasks/cancel is recorded as a request; polling finds the work finished: committed."""
    await server.hold("accepted:upload")  # past acceptance: the work cannot stop any more
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, immediate(server))
        key = await server.reached("accepted:upload")
        await ledger.cancel(started.run_id, by="user:1")
    while "task_cancel_requested" not in [
        e.kind for e in await ledger.backend.events(started.run_id)
    ]:
        await ledger.wait_for_change(started.run_id)
    assert (await ledger.backend.get_operation(key)).status is not OpStatus.NOT_COMMITTED
    await server.release("accepted:upload")
    op = await wait_status(ledger, key, OpStatus.COMMITTED)
    assert op.cause is Cause.USER_CANCEL
    assert len(await server.effects_of(key)) == 1


@TASK_ERA
async def test_mcp_task_cancelled_before_any_effect(
    ledger: stopline.Ledger, server: Server
) -> None:
    await server.hold("received:upload")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, immediate(server))
        key = await server.reached("received:upload")
        await ledger.cancel(started.run_id, by="user:1")
    op = await wait_status(ledger, key, OpStatus.NOT_COMMITTED)
    assert any(e.ref.startswith("task:") for e in op.evidence)
    assert await server.effects_of(key) == []


@TASK_ERA
async def test_mcp_vanished_task_is_unknown(ledger: stopline.Ledger, server: Server) -> None:
    """A task the server forgot (as a TTL would) is unknown: never cancelled, never done."""
    await server.hold("accepted:upload")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, immediate(server))
        key = await server.reached("accepted:upload")
        await server.ctl("ctl_forget_tasks")
        op = await wait_status(ledger, key, OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
        assert op.cause is Cause.SERVER_ERROR
        assert any("vanished" in e.detail for e in op.evidence)
        await server.release("accepted:upload")
    assert started.error is not None  # the workflow was told: no answer
