"""The server-side ``Effects`` record tells no effect ``not_committed`` that may have
happened, over real stdio servers (tests/support/recorded_server.py, and the
testing server for two processes on one file).

- A tool's result went through ``json.dumps`` after its effect: a ``datetime``
  or a pydantic model failed there, the async path recorded ``not_committed``
  and told the client so, and a retry with the same key committed again.
- A second server process on the same file (a stdio server per client) took
  the first one's work in flight for a crashed predecessor's at its start:
  ``not_committed``, and a retry through it committed a second time.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from mcp_types import RequestParamsMeta

import stopline
from mcp import Client, MCPError, StdioServerParameters
from stopline import OpStatus
from stopline.domain.limits import MAX_RESULT_CHARS
from stopline.integrations.mcp import KEY_META, OUTCOME_DATA, VERIFY_TOOL, Effects, StoplineMCP
from tests.mcp.conftest import ROOT, server_env, stdio_params

pytestmark = pytest.mark.timeout(60)
AT = "2026-12-06T09:30:00Z"


@pytest.fixture
async def conn(tmp_path: Path) -> AsyncIterator[StoplineMCP]:
    """A fresh server process per test: a test may leave its file size limit set."""
    args = ["tests/support/recorded_server.py", str(tmp_path / "effects.db")]
    params = StdioServerParameters(command=sys.executable, args=args, cwd=str(ROOT))
    params.env = server_env()
    async with StoplineMCP(params, name="recorded") as opened:
        yield opened


async def raw(client: Client, tool: str, key: str, **arguments: Any) -> Any:
    """A call with ``key`` in its ``_meta``, as any client may send it again."""
    meta = cast(RequestParamsMeta, {KEY_META: key})
    result = await client.call_tool(tool, arguments, meta=meta)
    assert not result.is_error, result
    return result.structured_content


async def ctl(client: Client, name: str) -> Any:
    result = await client.call_tool(name, {})
    assert not result.is_error, result
    assert result.structured_content is not None
    return result.structured_content.get("result", result.structured_content)


@pytest.mark.parametrize("tool", ["stamp", "receipt", "stamp_sync"])
async def test_a_result_json_cannot_write_is_recorded_and_replayed(
    ledger: stopline.Ledger, conn: StoplineMCP, tool: str
) -> None:
    """A ``datetime`` or a model in the result: committed, its JSON form recorded, and
    the same key again replays it without a second effect."""
    async with ledger.run("record", owner="user:1") as run:
        answered = await conn.call(run, tool, {})
    op = (await ledger.backend.operations(run.id))[0]
    assert op.status is OpStatus.COMMITTED
    assert answered == {"at": AT, "commit": 1} == op.result
    verify = await conn.client.call_tool(VERIFY_TOOL, {"key": op.id})
    assert verify.structured_content is not None
    assert verify.structured_content["verdict"] == "committed"
    assert verify.structured_content["result"] == {"at": AT, "commit": 1}
    assert await raw(conn.client, tool, op.id) == answered  # the record's answer
    assert len(await ctl(conn.client, "ctl_commits")) == 1  # and no second effect


@pytest.mark.parametrize("tool", ["stamp", "stamp_sync"])
async def test_an_outcome_the_disk_cannot_hold_is_unknown_and_never_run_again(
    ledger: stopline.Ledger, conn: StoplineMCP, tool: str
) -> None:
    """The disk fills as the effect commits (a real file size limit on the server):
    the record cannot say ``committed``. The client is told ``unknown``, never
    ``not_committed``; the server's record stays in doubt after the disk is freed;
    a retry with the same key is refused and the effect happened once."""
    async with ledger.run("full", owner="user:1") as run:
        with pytest.raises(stopline.NoAnswer):
            await conn.call(run, tool, {"fill": True})
    op = (await ledger.backend.operations(run.id))[0]
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
    assert await ctl(conn.client, "ctl_free_disk") is True
    verify = await conn.client.call_tool(VERIFY_TOOL, {"key": op.id})
    assert verify.structured_content is not None
    assert verify.structured_content["verdict"] == "unknown"
    assert "no outcome is recorded" in verify.structured_content["detail"]
    with pytest.raises(MCPError) as refused:
        await raw(conn.client, tool, op.id, fill=False)
    assert refused.value.error.data == {OUTCOME_DATA: "unknown"}
    assert "not run again" in refused.value.error.message
    assert await ctl(conn.client, "ctl_commits") == [tool]


async def test_a_result_with_no_json_form_still_records_the_commit(
    ledger: stopline.Ledger, conn: StoplineMCP
) -> None:
    """Bytes that are not UTF-8: the SDK cannot answer with them, so the client reads
    back, and the record says ``committed`` (without the result), as happened."""
    async with ledger.run("blob", owner="user:1") as run:
        with pytest.raises(stopline.NoAnswer):
            await conn.call(run, "blob", {})
    receipt = await ledger.wait_settled(run.id, timeout=20)
    op = (await ledger.backend.operations(run.id))[0]
    assert op.status is OpStatus.COMMITTED  # read back from the record
    assert receipt.headline is stopline.Headline.COMPLETED
    verify = await conn.client.call_tool(VERIFY_TOOL, {"key": op.id})
    assert verify.structured_content is not None
    assert verify.structured_content["verdict"] == "committed"
    assert "no JSON form" in verify.structured_content["detail"]
    assert await raw(conn.client, "blob", op.id) is None  # replayed: no second effect
    assert await ctl(conn.client, "ctl_commits") == ["blob"]


async def test_a_result_longer_than_a_record_keeps_records_the_commit_without_it(
    ledger: stopline.Ledger, conn: StoplineMCP
) -> None:
    """Past ``MAX_RESULT_CHARS`` (the ledger's limit too) the record keeps the state
    and not the result: the answer reaches the client, both records say committed."""
    async with ledger.run("long", owner="user:1") as run:
        answer = await conn.call(run, "long", {"size": MAX_RESULT_CHARS})
    assert answer == "x" * MAX_RESULT_CHARS
    op = (await ledger.backend.operations(run.id))[0]
    assert op.status is OpStatus.COMMITTED and not op.has_result  # nor in the ledger
    verify = await conn.client.call_tool(VERIFY_TOOL, {"key": op.id})
    assert verify.structured_content is not None
    assert verify.structured_content["verdict"] == "committed"
    assert f"{MAX_RESULT_CHARS + 2:,} characters" in verify.structured_content["detail"]
    assert await raw(conn.client, "long", op.id, size=1) is None  # replayed, no effect
    assert await ctl(conn.client, "ctl_commits") == ["long"]


async def test_a_second_server_on_the_file_leaves_the_firsts_work_in_flight(
    tmp_path: Path,
) -> None:
    """Two testing servers on one effects file. The first holds a call after accepting
    it; the second, started then, reads it in doubt (not ``not_committed``) and
    refuses the same key; the first commits it, once."""
    db = tmp_path / "effects.db"
    async with Client(stdio_params(db)) as first:
        await first.call_tool("ctl_hold", {"point": "accepted:upload"})
        async with anyio.create_task_group() as tg:
            answers: list[Any] = []

            async def call() -> None:
                answers.append(await raw(first, "upload", "k", payload="p"))

            tg.start_soon(call)
            await first.call_tool("ctl_reached", {"point": "accepted:upload"})
            async with Client(stdio_params(db)) as second:
                verify = await second.call_tool(VERIFY_TOOL, {"key": "k"})
                assert verify.structured_content is not None
                assert verify.structured_content["state"] == "accepted"
                assert verify.structured_content["verdict"] == "unknown"
                with pytest.raises(MCPError) as refused:
                    await raw(second, "upload", "k", payload="p")
                assert refused.value.error.data == {OUTCOME_DATA: "unknown"}
            await first.call_tool("ctl_release", {"point": "accepted:upload"})
        assert answers == [{"id": "k", "tool": "upload", "value": "p"}]
        truth = await first.call_tool("ctl_truth", {})
        assert truth.structured_content is not None
        assert [e["key"] for e in truth.structured_content["effects"]] == ["k"]  # one effect


def test_claims_in_a_file_from_before_owners_are_recovered_as_before(tmp_path: Path) -> None:
    """A file written before claims named their process: its unfinished claims are
    resolved at the next start, as they were then, and the column is added."""
    path = tmp_path / "effects.db"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE stopline_effects (key TEXT PRIMARY KEY, tool TEXT NOT NULL,"
            " state TEXT NOT NULL, result TEXT, detail TEXT NOT NULL DEFAULT '',"
            " cancel TEXT NOT NULL DEFAULT 'none', created_at REAL NOT NULL,"
            " updated_at REAL NOT NULL)"
        )
        db.execute(
            "INSERT INTO stopline_effects (key, tool, state, created_at, updated_at)"
            " VALUES ('a', 't', 'accepted', 0, 0), ('b', 't', 'committing', 0, 0)"
        )
    db.close()
    effects = Effects(path)
    assert effects.recovered == 2
    a, b = effects.store.get("a"), effects.store.get("b")
    assert a is not None and a.state.value == "not_committed"
    assert b is not None and b.state.value == "unknown"


async def test_a_cancel_the_log_cannot_record_still_stops_the_tool(conn: StoplineMCP) -> None:
    """The disk is full when a cancel arrives: the cancellation log cannot be written,
    and the cancel still reaches the tool; the server's session goes on."""
    client = conn.client

    async def waits() -> dict[str, list[str]]:
        return dict(await ctl(client, "ctl_waits"))

    async with anyio.create_task_group() as tg:

        async def call() -> None:
            await client.call_tool(
                "wait", {"fill": True}, meta=cast(RequestParamsMeta, {KEY_META: "w"})
            )

        tg.start_soon(call)
        while not (await waits())["waiting"]:
            pass  # each ask is a round trip to the server
        tg.cancel_scope.cancel()
    while not (await waits())["stopped"]:
        pass
    assert (await waits())["waiting"] == []
    assert await ctl(client, "ctl_free_disk") is True
    assert await raw(client, "stamp", "after") == {"at": AT, "commit": 1}


async def test_a_long_poll_waits_for_an_attempt_another_server_holds(tmp_path: Path) -> None:
    """``stopline_verify(wait_seconds=...)`` waited only for an attempt of its own
    process: one held by another server on the file answered at once, "unknown", and
    a client settling a cancel asked again in a busy loop. It waits for that one too."""
    db = tmp_path / "effects.db"
    async with Client(stdio_params(db)) as first, Client(stdio_params(db)) as second:
        await first.call_tool("ctl_hold", {"point": "accepted:upload"})
        async with anyio.create_task_group() as tg:
            verdicts: list[Any] = []

            async def call() -> None:
                await raw(first, "upload", "k", payload="p")

            async def verify() -> None:
                answer = await second.call_tool(VERIFY_TOOL, {"key": "k", "wait_seconds": 30})
                assert answer.structured_content is not None
                verdicts.append(answer.structured_content["verdict"])

            tg.start_soon(call)
            await first.call_tool("ctl_reached", {"point": "accepted:upload"})
            tg.start_soon(verify)
            await second.call_tool("ctl_truth", {})  # answered after the verify was taken up
            assert verdicts == []
            await first.call_tool("ctl_release", {"point": "accepted:upload"})
        assert verdicts == ["committed"]


async def test_a_long_poll_answers_once_the_outcome_is_recorded_not_when_the_call_ends(
    tmp_path: Path,
) -> None:
    """A call held after its commit (the server has yet to answer): its record says
    ``committed``, but a long poll waited for the call to end, so a client reading a
    cancelled call back waited out its whole poll (5 s by default) for what the record
    already held. It answers as soon as the outcome is recorded, the call still held
    (the bound below is well under the poll's 30 s, which it waited before)."""
    async with Client(stdio_params(tmp_path / "effects.db")) as client:
        await client.call_tool("ctl_hold", {"point": "committed:upload"})
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(raw, client, "upload", "k", payload="p"))
            await client.call_tool("ctl_reached", {"point": "committed:upload"})
            with anyio.fail_after(20):
                answer = await client.call_tool(VERIFY_TOOL, {"key": "k", "wait_seconds": 30})
            await client.call_tool("ctl_release", {"point": "committed:upload"})
    assert answer.structured_content is not None
    assert answer.structured_content["verdict"] == "committed"


async def test_a_long_poll_hears_a_refused_cancel_at_once(tmp_path: Path) -> None:
    """``deploy`` refuses every cancel once accepted. A long poll taken up before the
    cancel came answered only when the call ended (here: never, while it is held);
    now the refusal wakes it, the call still held."""
    async with Client(stdio_params(tmp_path / "effects.db")) as client:
        await client.call_tool("ctl_hold", {"point": "accepted:deploy"})
        answers: list[dict[str, Any]] = []
        cut, heard = anyio.CancelScope(), anyio.Event()

        async def call() -> None:
            with cut:
                await raw(client, "deploy", "k", payload="p")

        async def long_poll() -> None:
            answer = await client.call_tool(VERIFY_TOOL, {"key": "k", "wait_seconds": 30})
            assert answer.structured_content is not None
            answers.append(answer.structured_content)
            heard.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await client.call_tool("ctl_reached", {"point": "accepted:deploy"})
            tg.start_soon(long_poll)
            await client.call_tool("ctl_truth", {})  # answered after the poll was taken up
            assert answers == []
            with anyio.fail_after(20):
                cut.cancel()  # the SDK sends notifications/cancelled
                await heard.wait()
            await client.call_tool("ctl_release", {"point": "accepted:deploy"})
    assert answers[0]["cancel"] == "refused" and answers[0]["state"] == "accepted", answers


async def test_a_server_that_ended_leaves_no_claim_in_progress_for_the_one_that_runs(
    tmp_path: Path,
) -> None:
    """Two testing servers on one effects file; the first dies holding one call before
    its commit section and one inside it. Its claims were resolved only when a server
    next started: the one that ran on read them "in progress" and refused their keys
    until a restart. It resolves them as soon as it reads them, as a start would."""
    db = tmp_path / "effects.db"
    async with Client(stdio_params(db)) as second:
        with contextlib.suppress(Exception):  # the first's session ends with its process
            async with Client(stdio_params(db)) as first:
                await first.call_tool("ctl_hold", {"point": "accepted:upload"})
                await first.call_tool("ctl_hold", {"point": "sync:sync_commit"})
                async with anyio.create_task_group() as tg:

                    async def call(tool: str, key: str) -> None:
                        with contextlib.suppress(Exception):  # no answer: the process died
                            await raw(first, tool, key, payload="p")

                    tg.start_soon(call, "upload", "before")
                    tg.start_soon(call, "sync_commit", "inside")
                    await first.call_tool("ctl_reached", {"point": "accepted:upload"})
                    await first.call_tool("ctl_reached", {"point": "sync:sync_commit"})
                    status = await second.call_tool(VERIFY_TOOL, {"key": "before"})
                    assert status.structured_content is not None
                    assert status.structured_content["state"] == "accepted"  # alive: in doubt
                    await first.call_tool("ctl_die", {})
        before = await second.call_tool(VERIFY_TOOL, {"key": "before", "wait_seconds": 30})
        inside = await second.call_tool(VERIFY_TOOL, {"key": "inside"})
        assert before.structured_content is not None and inside.structured_content is not None
        assert before.structured_content["verdict"] == "not_committed"
        assert "ended before the commit" in before.structured_content["detail"]
        assert inside.structured_content["verdict"] == "unknown"
        assert inside.structured_content["state"] == "unknown"
        assert await raw(second, "upload", "before", payload="p") == {
            "id": "before",
            "tool": "upload",
            "value": "p",
        }  # provably not committed: the retry runs
        with pytest.raises(MCPError) as refused:  # it may have committed: never run again
            await raw(second, "sync_commit", "inside", payload="p")
        assert refused.value.error.data == {OUTCOME_DATA: "unknown"}
        truth = await second.call_tool("ctl_truth", {})
        assert truth.structured_content is not None
        assert [e["key"] for e in truth.structured_content["effects"]] == ["before"]
