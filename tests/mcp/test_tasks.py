"""MCP tasks through StoplineMCP, both eras (2026-07-28 extension, 2025-11-25 core) over
stdio and Streamable HTTP: what a task-backed call records, and the races the spec names
(a cancel against the work finishing, a task that vanished or expired)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from stopline import Cause, OpStatus, PhaseKind, Policy
from stopline.integrations.mcp import KEY_META, ToolPolicy
from stopline.integrations.mcp.tasks_client import raw_request
from stopline.runtime.context import CallContext
from tests.mcp.conftest import TRANSPORTS, Server, open_server, wait_status
from tests.scenarios.workflows import Started, start

pytestmark = pytest.mark.timeout(30)
Body = Callable[[stopline.Run, Started], Awaitable[None]]
TASKS = {"upload": ToolPolicy(task=True)}  # 2025: ask for a task; 2026: the server decides


@pytest.fixture(scope="module", params=TRANSPORTS)
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


async def cancel_requested(ledger: stopline.Ledger, run_id: str) -> str:
    """The ``task_cancel_requested`` note's detail, once it is written."""
    while True:
        for event in await ledger.backend.events(run_id):
            if event.kind == "task_cancel_requested":
                return str(event.data.get("detail", ""))
        await ledger.wait_for_change(run_id)


async def attached(ledger: stopline.Ledger, op: stopline.OperationRecord, text: str) -> None:
    """Until ``text`` is in the operation's evidence, or in a note agreeing with it."""
    while True:
        current = await ledger.backend.get_operation(op.id)
        events = [e for e in await ledger.backend.events(op.run_id) if e.op_id == op.id]
        if any(text in e.detail for e in current.evidence) or any(
            text in str(e.data) for e in events
        ):
            return
        await ledger.wait_for_change(op.run_id)


async def test_mcp_task_completes_and_commits(ledger: stopline.Ledger, server: Server) -> None:
    async with ledger.run("task", owner="user:1") as run:
        result = await server.conn.call(run, "upload", {"payload": "t"})
    op = (await ledger.backend.operations(run.id))[0]
    assert result == {"id": op.id, "tool": "upload", "value": "t"}
    assert op.status is OpStatus.COMMITTED
    assert any(e.ref.startswith("task:") for e in op.evidence)  # accepted when the task existed
    assert len(await server.effects_of(op.id)) == 1


async def test_mcp_task_cancel_is_a_request_then_the_truth(
    ledger: stopline.Ledger, server: Server
) -> None:
    """tasks/cancel is recorded as a request; following the task finds the work finished:
    committed. In 2025 the task said ``cancelled`` at once: that proved nothing."""
    await server.hold("accepted:upload")  # past acceptance: the work cannot stop any more
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, immediate(server))
        key = await server.reached("accepted:upload")
        await ledger.cancel(started.run_id, by="user:1")
    detail = await cancel_requested(ledger, started.run_id)
    if server.era == "2026":
        assert "acknowledged" in detail
    else:
        assert "status cancelled" in detail and "proves nothing" in detail
    assert (await ledger.backend.get_operation(key)).status is not OpStatus.NOT_COMMITTED
    await server.release("accepted:upload")
    op = await wait_status(ledger, key, OpStatus.COMMITTED)
    assert op.cause is Cause.USER_CANCEL
    assert len(await server.effects_of(key)) == 1


async def test_mcp_task_cancelled_before_any_effect(
    ledger: stopline.Ledger, server: Server
) -> None:
    """``cancelled`` counts as not_committed only because the server proves it
    (``io.stopline/outcome`` from its Effects record)."""
    await server.hold("received:upload")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, immediate(server))
        key = await server.reached("received:upload")
        # the client knows the task (its CreateTaskResult may come after the server's
        # work began: on 2026 HTTP another stream), so the cancel is a tasks/cancel
        await wait_status(ledger, key, OpStatus.ACCEPTED)
        await ledger.cancel(started.run_id, by="user:1")
    op = await wait_status(ledger, key, OpStatus.NOT_COMMITTED)
    await attached(ledger, op, "server record: not_committed")  # the task's own word (R4)
    assert (await ledger.backend.get_operation(key)).status is OpStatus.NOT_COMMITTED
    assert await server.effects_of(key) == []


async def test_mcp_task_cancelled_while_its_creation_is_recorded(
    ledger: stopline.Ledger, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task exists once its CreateTaskResult is in: a cancel that lands while the
    client is still recording that (``accepted``, ref ``task:<id>``) must still send
    tasks/cancel and follow the task, or the work goes on unasked and unobserved."""
    recording = anyio.Event()
    record_accepted = CallContext.accepted

    async def accepted(self: CallContext, ref: str = "", detail: str = "") -> None:
        if ref.startswith("task:"):
            recording.set()
            await anyio.Event().wait()  # the cancel lands here, or nowhere
        await record_accepted(self, ref, detail)

    monkeypatch.setattr(CallContext, "accepted", accepted)
    await server.hold("received:upload")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, immediate(server))
        key = await server.reached("received:upload")
        await recording.wait()
        await ledger.cancel(started.run_id, by="user:1")
    op = await wait_status(ledger, key, OpStatus.NOT_COMMITTED)
    await attached(ledger, op, "server record: not_committed")
    assert await server.effects_of(key) == []
    await server.release("received:upload")


async def test_mcp_vanished_task_is_unknown_then_read_back(
    ledger: stopline.Ledger, server: Server
) -> None:
    """A task the server forgot (as a TTL would) is unknown, never cancelled; the read-back
    (stopline_verify) then settles what really happened."""
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
    op = await wait_status(ledger, key, OpStatus.COMMITTED)
    assert op.status is OpStatus.COMMITTED
    assert len(await server.effects_of(key)) == 1


@pytest.mark.parametrize("transport", ["stdio-2026", "stdio-legacy"])
async def test_mcp_task_lost_create_result(
    ledger: stopline.Ledger, tmp_path: Path, transport: str
) -> None:
    """The server creates the task and dies before its CreateTaskResult is written: the
    client never learns the task id. 2026: the request is re-issued with the same key (one
    operation, two attempts) and commits once. 2025: unknown, then the read-back by key
    (the restarted server's record) proves nothing happened."""
    async for server in open_server(transport, tmp_path, None, tasks=True, policies=TASKS):
        await server.fault("upload", "lose-create")
        async with ledger.run("lost", owner="user:1") as run:
            with contextlib.suppress(stopline.NoAnswer):
                await server.conn.call(run, "upload", {"payload": "t"})
        op = (await ledger.backend.operations(run.id))[0]
        events = [e.kind for e in await ledger.backend.events(run.id)]
        if server.era == "2026":
            assert op.status is OpStatus.COMMITTED
            assert events.count("mcp_reissued") == 1
            assert len(await server.effects_of(op.id)) == 1
        else:
            assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
            assert op.cause is Cause.TRANSPORT
            op = await ledger.verify(op.id)
            assert op.status is OpStatus.NOT_COMMITTED
            assert await server.effects_of(op.id) == []


@pytest.fixture(scope="module")
async def legacy(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    """The testing server over stdio, 2025-11-25: the client asks for a task's TTL."""
    tmp = tmp_path_factory.mktemp("legacy-ttl")
    async for opened in open_server("stdio-legacy", tmp, None, tasks=True, policies=TASKS):
        yield opened


@pytest.mark.parametrize("ttl", [-1, 0, True, 1e400], ids=["negative", "zero", "bool", "huge"])
async def test_a_ttl_no_task_can_keep_gets_the_servers_own(legacy: Server, ttl: Any) -> None:
    """A client asks for a task with a ``ttl`` of -1 (or 0, ``true``, ``1e400``). The
    server keeps it for its own TTL: a -1 was taken as asked, and the task was purged
    before anyone could read it, its work running on."""
    session = legacy.conn.client.session
    params: dict[str, Any] = {"name": "upload", "arguments": {"payload": "ttl"}}
    params |= {"task": {"ttl": ttl}, "_meta": {KEY_META: f"ttl-{ttl}"}}
    created = await raw_request(session, "tools/call", params)
    task = created["task"]
    assert task["ttl"] == 600_000
    read = await raw_request(session, "tasks/get", {"taskId": task["taskId"]})
    assert read["taskId"] == task["taskId"]
