"""Faults over a real stdio MCP server, in both protocol eras: late answers (S9),
-32800 and ``code: 0`` answers to a cancelled request, a sync tool that commits
after the cancel, the process dying and the stream breaking mid-call (S16),
malformed messages, and each cause told apart in the ledger."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any, cast

import anyio
import pytest
from mcp_types import RequestParamsMeta

import stopline
from mcp import MCPError
from stopline import Cause, Headline, OpStatus, PhaseKind, Policy
from stopline.integrations.mcp import KEY_META
from tests.mcp.conftest import Server, open_server, wait_status
from tests.scenarios.workflows import Started, start

pytestmark = pytest.mark.timeout(30)
ERAS = ["stdio-legacy", "stdio-2026"]


@pytest.fixture(scope="module", params=ERAS)
async def plain(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Server]:
    """A server that honours cancels (an SDK server never answers a cancelled request)."""
    async for opened in open_server(str(request.param), tmp_path_factory.mktemp("plain")):
        yield opened


@pytest.fixture(scope="module", params=ERAS)
async def ignoring(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Server]:
    """A server that drops every ``notifications/cancelled`` and answers anyway."""
    tmp = tmp_path_factory.mktemp("ignoring")
    async for opened in open_server(str(request.param), tmp, None, "--ignore-cancel"):
        yield opened


def immediate(
    server: Server, tool: str, payload: str = "p", policy: Policy = Policy.IMMEDIATE
) -> Any:
    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, policy):
            started.results.append(await server.conn.call(run, tool, {"payload": payload}))

    return body


async def test_s09_mcp_late_success_after_cancel(ledger: stopline.Ledger, ignoring: Server) -> None:
    """The server ignores the cancel and answers: kept, committed, workflow not restarted."""
    await ignoring.hold("received:upload")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, immediate(ignoring, "upload"))
        key = await ignoring.reached("received:upload")
        await ledger.cancel(started.run_id, by="user:1")
    op = await ledger.backend.get_operation(key)
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)  # R3: not "not sent"
    await ignoring.release("received:upload")
    op = await wait_status(ledger, key, OpStatus.COMMITTED)
    assert op.result == {"id": key, "tool": "upload", "value": "p"}
    receipt = await ledger.wait_settled(started.run_id, timeout=20)
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    while not [e for e in await ledger.backend.events(started.run_id) if e.data.get("late")]:
        await ledger.wait_for_change(started.run_id)  # kept as evidence, marked late (R4)
    assert started.entries == 1
    assert any(a.key == key for a in ignoring.conn.late)
    log = await ignoring.cancellations_of(key)
    assert [c["via"] for c in log] == ["ignored"]  # the server says it refused the cancel


@pytest.mark.parametrize("answer", ["answer-32800", "answer0"])
async def test_mcp_error_answer_to_a_cancelled_request_is_evidence_only(
    ledger: stopline.Ledger, ignoring: Server, answer: str
) -> None:
    """-32800 or ``code: 0`` after a cancel proves nothing: kept; the read-back decides."""
    await ignoring.fault("upload", answer)
    await ignoring.hold("responding:upload")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, immediate(ignoring, "upload"))
        key = await ignoring.reached("responding:upload")
        await ledger.cancel(started.run_id, by="user:1")
    await ignoring.release("responding:upload")
    while not any(e.kind == "late_response" for e in await ledger.backend.events(started.run_id)):
        await ledger.wait_for_change(started.run_id)
    op = await ledger.verify(key)
    assert op.status is OpStatus.COMMITTED  # the server's durable record
    assert op.cause is Cause.USER_CANCEL


async def test_mcp_sync_tool_commits_after_cancel(ledger: stopline.Ledger, plain: Server) -> None:
    """A def tool cannot be interrupted: it commits after the cancel and the record shows it."""
    await plain.hold("sync:sync_commit")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, immediate(plain, "sync_commit"))
        key = await plain.reached("sync:sync_commit")
        await ledger.cancel(started.run_id, by="user:1")
    await plain.release("sync:sync_commit")
    status = await plain.conn.status(key, wait_seconds=20)
    while status["state"] == "committing":  # a long poll answers a refused cancel at once
        status = await plain.conn.status(key, wait_seconds=20)
    assert status["verdict"] == "committed", status
    op = await ledger.verify(key)
    assert op.status is OpStatus.COMMITTED
    assert op.cause is Cause.USER_CANCEL
    receipt = await ledger.wait_settled(started.run_id, timeout=20)
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert len(await plain.effects_of(key)) == 1


@pytest.mark.parametrize("fault", ["die", "break"])
async def test_s16_mcp_connection_drops_before_the_response(
    ledger: stopline.Ledger, plain: Server, fault: str
) -> None:
    """Process dies / stream breaks after the commit: no second effect. Legacy: unknown,
    read back. 2026-07-28: the lost request is re-issued with a new JSON-RPC id and the
    same idempotency key, one operation with two attempts (the server replays its record)."""
    await plain.fault("upload", fault)
    before = plain.conn.connections
    sent: list[tuple[str, Any]] = []
    plain.conn.on_request = lambda key, request_id: sent.append((key, request_id))
    outcome: dict[str, Any] = {}
    try:
        async with ledger.run("s16", owner="user:1") as run:
            try:
                outcome["first"] = await plain.conn.call(
                    run, "upload", {"payload": "file it"}, key="ticket"
                )
            except stopline.NoAnswer as exc:
                outcome["first"] = exc.cause
            outcome["retry"] = await plain.conn.call(
                run, "upload", {"payload": "file it"}, key="ticket"
            )
    finally:
        plain.conn.on_request = None
    op = (await ledger.backend.operations(run.id))[0]
    expected = {"id": op.id, "tool": "upload", "value": "file it"}
    assert outcome["retry"] == expected
    assert op.status is OpStatus.COMMITTED
    assert plain.conn.connections == before + 1  # a new server process, the same durable record
    assert len(await plain.effects_of(op.id)) == 1  # no second effect
    reissued = [e for e in await ledger.backend.events(run.id) if e.kind == "mcp_reissued"]
    if plain.era == "2026":
        assert outcome["first"] == expected  # the re-issue answered
        assert [e.data["attempt"] for e in reissued] == [2]
        ids = [rid for key, rid in sent if key == op.id]
        assert len(ids) == 2 and ids[0] != ids[1]  # two JSON-RPC ids, one key
    else:
        assert outcome["first"] is Cause.TRANSPORT
        assert op.cause is Cause.TRANSPORT
        assert reissued == []


async def test_mcp_process_dies_before_commit_is_not_committed(
    ledger: stopline.Ledger, plain: Server
) -> None:
    """Died mid-call before its commit section. Legacy: the restarted server proves nothing
    happened. 2026-07-28: the lost request is re-issued (same key, the run still running)
    and the new server process does it, once."""
    await plain.hold("accepted:upload")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, immediate(plain, "upload"))
        key = await plain.reached("accepted:upload")
        with pytest.raises(MCPError):
            await plain.ctl("ctl_die")
        if plain.era == "2026":
            op = await wait_status(ledger, key, OpStatus.COMMITTED)
            kinds = [e.kind for e in await ledger.backend.events(op.run_id)]
            assert kinds.count("mcp_reissued") == 1
            assert len(await plain.effects_of(key)) == 1
            return
    op = await ledger.backend.get_operation(key)
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
    assert op.cause is Cause.TRANSPORT
    op = await ledger.verify(key)  # a new server process reads the durable record
    assert op.status is OpStatus.NOT_COMMITTED
    assert await plain.effects_of(key) == []
    receipt = await ledger.wait_settled(started.run_id, timeout=20)
    assert receipt.headline is Headline.FAILED  # the workflow saw the transport error


async def test_mcp_reissue_never_crosses_the_fence(ledger: stopline.Ledger, plain: Server) -> None:
    """A run fenced while its request was in flight: the lost request is not re-sent (R1).
    (``notify`` cannot cancel, so an ``at_boundary`` cancel lets the call go on.)"""
    await plain.hold("accepted:notify")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, immediate(plain, "notify", policy=Policy.AT_BOUNDARY))
        key = await plain.reached("accepted:notify")
        await ledger.cancel(started.run_id, by="user:1")
        with pytest.raises(MCPError):
            await plain.ctl("ctl_die")
    kinds = [e.kind for e in await ledger.backend.events(started.run_id)]
    assert "mcp_reissued" not in kinds
    op = await ledger.verify(key)
    assert op.status is OpStatus.NOT_COMMITTED
    assert await plain.effects_of(key) == []


async def test_mcp_malformed_messages_do_not_lose_the_call(
    ledger: stopline.Ledger, plain: Server
) -> None:
    await plain.fault("upload", "garbage")
    before = plain.conn.connections
    async with ledger.run("garbage", owner="user:1") as run:
        result = await plain.conn.call(run, "upload", {"payload": "ok"})
        again = await plain.conn.call(run, "upload", {"payload": "still ok"})
    assert result["value"] == "ok" and again["value"] == "still ok"
    assert plain.conn.connections == before
    statuses = [op.status for op in await ledger.backend.operations(run.id)]
    assert statuses == [OpStatus.COMMITTED, OpStatus.COMMITTED]


async def test_mcp_causes_are_told_apart(ledger: stopline.Ledger, plain: Server) -> None:
    """Refused before any effect, server error and timeout each get their own record."""
    await plain.fault("upload", "reject")
    await plain.hold("received:notify")
    async with ledger.run("causes", owner="user:1") as run:
        with pytest.raises(stopline.Rejected):
            await plain.conn.call(run, "upload", {"payload": "x"}, key="refused")
        await plain.fault("upload", "answer0")  # the server answers an error of its own
        with pytest.raises(stopline.NoAnswer) as server_error:
            await plain.conn.call(run, "upload", {"payload": "y"}, key="bad")
        with pytest.raises(stopline.NoAnswer) as timeout:
            await plain.conn.call(run, "notify", {"payload": "x"}, key="slow", idle_timeout=0.05)
    await plain.release("received:notify")
    ops = {op.id.split("/", 1)[1]: op for op in await ledger.backend.operations(run.id)}
    assert ops["refused"].status is OpStatus.NOT_COMMITTED
    assert server_error.value.cause is Cause.SERVER_ERROR
    assert ops["bad"].cause is Cause.SERVER_ERROR
    assert timeout.value.cause is Cause.TIMEOUT
    assert ops["slow"].cause is Cause.TIMEOUT


async def test_mcp_call_idle_timeout_that_is_no_wait_is_refused_before_the_gate(
    ledger: stopline.Ledger, plain: Server
) -> None:
    """A NaN silence reached the call's deadline after the gate: the request never went
    and the operation stayed ``unknown``. Refused first now, nothing recorded or sent."""
    async with ledger.run("no-wait", owner="user:1") as run:
        for bad in (math.nan, -1.0):
            with pytest.raises(stopline.InvalidInput, match="idle_timeout"):
                await plain.conn.call(run, "upload", {"payload": "x"}, key="k", idle_timeout=bad)
        assert await ledger.backend.operations(run.id) == []
        await plain.conn.call(run, "upload", {"payload": "x"}, key="k", idle_timeout=30)
    [op] = await ledger.backend.operations(run.id)
    assert op.status is OpStatus.COMMITTED


async def test_mcp_arguments_no_request_can_carry_are_refused_and_the_connection_lives(
    ledger: stopline.Ledger, plain: Server
) -> None:
    """A lone surrogate in the arguments (``os.fsdecode`` of a non-UTF-8 file name
    makes one) failed the SDK's JSON writer after the gate: the connection closed, and
    another run's call in flight on it failed with the refused one. Refused before the
    gate now, for an effect and for a read; the other call completes."""
    await plain.hold("received:notify")
    other: list[Any] = []

    async def in_flight() -> None:
        async with ledger.run("other", owner="user:1") as run:
            other.append(await plain.conn.call(run, "notify", {"payload": "fine"}, key="o"))

    connections = plain.conn.connections
    async with anyio.create_task_group() as tg:
        tg.start_soon(in_flight)
        await plain.reached("received:notify")
        async with ledger.run("bad", owner="user:1") as run:
            with pytest.raises(stopline.InvalidInput, match="arguments") as refused:
                await plain.conn.call(run, "upload", {"payload": "report-\udc80.pdf"}, key="b")
            assert "surrogates not allowed" in str(refused.value)
            assert await ledger.backend.operations(run.id) == []
            with pytest.raises(stopline.InvalidInput, match="arguments"):
                await plain.conn.call(run, "lookup", {"key": "\udc80"})  # a read
        await plain.release("received:notify")
    assert len(other) == 1 and plain.conn.connections == connections


async def test_mcp_call_timeout_is_the_deprecated_name_of_the_allowed_silence(
    ledger: stopline.Ledger, plain: Server
) -> None:
    """ADR 0030: ``timeout=`` on ``StoplineMCP.call`` still means the silence, and warns."""
    await plain.hold("received:notify")
    async with ledger.run("renamed", owner="user:1") as run:
        with pytest.raises(TypeError, match="idle_timeout"):
            await plain.conn.call(run, "notify", {}, key="both", timeout=1, idle_timeout=1)
        with (
            pytest.warns(DeprecationWarning, match=r"StoplineMCP\.call\(timeout=\)") as warned,
            pytest.raises(stopline.NoAnswer) as silent,
        ):
            await plain.conn.call(run, "notify", {"payload": "x"}, key="old", timeout=0.05)
    await plain.release("received:notify")
    assert [w.filename for w in warned] == [__file__]  # it points at the caller
    assert silent.value.cause is Cause.TIMEOUT
    assert "idle_timeout 0.05s" in silent.value.detail


async def test_mcp_call_takes_the_options_of_run_call(
    ledger: stopline.Ledger, plain: Server
) -> None:
    """``needs_approval`` and ``retry`` reach the gate as they do from ``run.call``."""
    async with ledger.run("options", owner="user:1") as run:
        with pytest.raises(stopline.ApprovalNeeded):
            await plain.conn.call(run, "upload", {"payload": "x"}, key="ask", needs_approval=True)
        await plain.fault("upload", "reject")  # one refusal, then the retry commits
        retry = stopline.Retry(attempts=2, backoff=0.0)
        await plain.conn.call(run, "upload", {"payload": "y"}, key="again", retry=retry)
    events = await ledger.backend.events(run.id)
    assert await plain.effects_of(f"{run.id}/ask") == []
    assert [e.kind for e in events if e.op_id == f"{run.id}/again"].count("gate_passed") == 2
    assert len(await plain.effects_of(f"{run.id}/again")) == 1


async def test_mcp_server_idempotency_by_key(plain: Server) -> None:
    """A repeated key returns the recorded result, never a second effect."""
    client = plain.conn.client
    meta = cast(RequestParamsMeta, {KEY_META: "same-key"})
    first = await client.call_tool("upload", {"payload": "once"}, meta=meta)
    second = await client.call_tool("upload", {"payload": "once"}, meta=meta)
    assert first.structured_content == second.structured_content
    assert len(await plain.effects_of("same-key")) == 1
    never = await plain.conn.status("never-sent", tool="upload")
    assert never["verdict"] == "not_committed"
