"""What ``stopline_verify`` may say of a key a tracked tool's call brought and left no
record of, asked from clients stopline did not write (the official ``mcp`` SDK's
``Client``, ``fastmcp``'s ``Client``) over real stdio and real Streamable HTTP, with real
server processes that die and restart (ADR 0067).

The server (``tests/support/edges_server.py``) declares every tool tracked and keeps
its own ground truth apart from the ``Effects`` record. Before ADR 0067 the server
answered "this server never saw the key: not_committed" for each of these keys:

- a call whose body made its effect and failed before recording anything (a bug the
  client cannot tell from an argument refusal: both are ``isError`` results);
- a call cancelled once its body had made its effect;
- a call another server process on the same file was still running (it committed
  after the answer);
- a call that was running when its server process died (asked of the next process).
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from fastmcp import Client as FastClient
from fastmcp.client.transports import StdioTransport
from mcp_types import RequestParamsMeta

from mcp import Client, MCPError, StdioServerParameters
from stopline.integrations.mcp import KEY_META, OUTCOME_DATA, REJECTED_CODE, VERIFY_TOOL, Effects
from stopline.integrations.mcp._store import Ending, Unrecorded
from tests.mcp.conftest import ROOT, TRANSPORTS, serve_http, server_env

pytestmark = pytest.mark.timeout(90)

SERVER = "tests/support/edges_server.py"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def stdio(db: Path) -> StdioServerParameters:
    args = [SERVER, "--db", str(db)]
    return StdioServerParameters(command=sys.executable, args=args, cwd=str(ROOT), env=server_env())


@asynccontextmanager
async def edges(transport: str, db: Path) -> AsyncIterator[Client]:
    """The official SDK's client of the edges server, over ``transport``."""
    kind, era = transport.split("-")
    mode = "legacy" if era == "legacy" else "2026-07-28"
    if kind == "stdio":
        async with Client(stdio(db), mode=mode) as client:
            yield client
    else:
        with serve_http(SERVER, "--db", str(db)) as url:
            async with Client(url, mode=mode) as client:
                yield client


def keyed(key: str) -> RequestParamsMeta:
    return cast(RequestParamsMeta, {KEY_META: key})


async def ctl(client: Client, name: str, **arguments: Any) -> Any:
    result = await client.call_tool(name, arguments)
    assert not result.is_error, result
    assert result.structured_content is not None
    return result.structured_content.get("result", result.structured_content)


async def verify(client: Client, key: str, tool: str, wait: float = 0) -> dict[str, Any]:
    arguments = {"key": key, "tool": tool, "wait_seconds": wait}
    result = await client.call_tool(VERIFY_TOOL, arguments)
    assert not result.is_error and isinstance(result.structured_content, dict), result
    return result.structured_content


async def effects_of(client: Client, key: str) -> list[dict[str, str]]:
    return [e for e in await ctl(client, "ctl_truth") if e["key"] == key]


async def long_poll_over_release(
    asker: Client, key: str, tool: str, holder: Client, point: str
) -> dict[str, Any]:
    """``asker``'s long poll of ``key`` while its call is held at ``point`` (it must wait),
    then the call released: what the long poll answered."""
    waited: list[dict[str, Any]] = []

    async def long_poll() -> None:
        waited.append(await verify(asker, key, tool, wait=30))

    async with anyio.create_task_group() as tg:
        tg.start_soon(long_poll)
        await ctl(asker, "ctl_truth")  # answered after the long poll was taken up
        assert waited == []  # it waits for the call, wherever it runs
        await ctl(holder, "ctl_release", point=point)
    return waited[0]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_body_that_failed_unrecorded_is_told_from_an_argument_refusal(
    tmp_path: Path, transport: str
) -> None:
    """Three ``isError`` answers the client cannot tell apart. Only the refusal of the
    arguments (the SDK's, before the body ran) proves nothing happened; a body that ran
    and failed before recording may have acted (``leaky`` did), and so may an honest
    body that refused before recording (``precheck``: its record cannot show it)."""
    async with edges(transport, tmp_path / "effects.db") as client:
        refused = await client.call_tool("pay", {"amount": "ten"}, meta=keyed("refused"))
        leaked = await client.call_tool("leaky", {"payload": "p"}, meta=keyed("leaked"))
        checked = await client.call_tool("precheck", {"amount": 500}, meta=keyed("checked"))
        assert refused.is_error and leaked.is_error and checked.is_error
        assert len(await effects_of(client, "leaked")) == 1  # the bug acted, then failed
        answers = {
            k: await verify(client, k, t)
            for k, t in [("refused", "pay"), ("leaked", "leaky"), ("checked", "precheck")]
        }
        # the refused key stays usable: a later call with it runs, once
        paid = await client.call_tool("pay", {"amount": 10}, meta=keyed("refused"))
        assert not paid.is_error
        assert (await verify(client, "refused", "pay"))["verdict"] == "committed"
        assert len(await effects_of(client, "refused")) == 1
    assert answers["refused"]["verdict"] == "not_committed", answers["refused"]
    assert answers["refused"]["tracked"] is True
    for key, tool in (("leaked", "leaky"), ("checked", "precheck")):
        assert answers[key]["verdict"] == "unknown", answers[key]  # before: not_committed
        assert answers[key]["detail"] == (
            f"tool {tool!r} ran with this key and ended without a result, recording nothing"
        )


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_call_cancelled_after_its_body_acted_leaves_its_key_unknown(
    tmp_path: Path, transport: str
) -> None:
    """``leaky`` made its effect and waits; the client stops waiting (the SDK cancels the
    request as its transport does). The server's long poll waits for the call to end,
    then says what the record can: unknown, never "not committed"."""
    async with edges(transport, tmp_path / "effects.db") as client:
        await ctl(client, "ctl_hold", point="body:leaky")
        cut = anyio.CancelScope()

        async def call() -> None:
            with cut:
                await client.call_tool("leaky", {"payload": "p"}, meta=keyed("cut"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            assert await ctl(client, "ctl_reached", point="body:leaky") == "cut"
            cut.cancel()
        answer = await verify(client, "cut", "leaky", wait=20)
        assert len(await effects_of(client, "cut")) == 1  # it acted
    assert cut.cancelled_caught
    assert answer["verdict"] == "unknown", answer  # before: not_committed, at once
    assert "was cancelled with this key once it may have run" in answer["detail"]


async def test_a_deadline_that_runs_out_as_the_record_begins_leaves_no_key_in_progress(
    tmp_path: Path,
) -> None:
    """``hurried`` bounds its work with a deadline of its own; one run out as its record
    begins (0 s: the first checkpoint is the record's) cut the begin itself, and the key
    stayed live in the server process for good: read "received, nothing recorded yet"
    (``unknown``) and waited for by every later call of it, which never answered. The
    begin is one local write and is not cut: once begun, the call commits (shielded,
    as every commit) and answers; a second call with the key replays it."""
    async with edges("stdio-2026", tmp_path / "effects.db") as client:
        first = await client.call_tool("hurried", {"payload": "p", "seconds": 0}, meta=keyed("h"))
        answer = await verify(client, "h", "hurried")
        with anyio.fail_after(30):  # a bound on the wait: before, it never answered
            again = await client.call_tool(
                "hurried", {"payload": "p", "seconds": 30}, meta=keyed("h")
            )
        assert len(await effects_of(client, "h")) == 1
    assert not first.is_error, first
    assert answer["verdict"] == "committed", answer
    assert not again.is_error and again.structured_content == first.structured_content


@pytest.mark.parametrize("transport", ["stdio-legacy", "http-2026"])
async def test_a_full_disk_refuses_a_call_before_it_runs_and_keeps_one_that_ran(
    tmp_path: Path, transport: str
) -> None:
    """The file cannot grow. A tracked call whose arrival cannot be written is refused
    before anything of the tool runs (-32090, ``not_committed``: the client need not
    ask), and runs once there is room. ``leaky`` fills the disk after its effect: the
    client gets the tool's own answer, and the key, whose end could not be written,
    reads in progress, never "not committed"."""
    async with edges(transport, tmp_path / "effects.db") as client:
        await ctl(client, "ctl_fill_disk", fill=True)
        with pytest.raises(MCPError) as refused:
            await client.call_tool("pay", {"amount": 1}, meta=keyed("full"))
        await ctl(client, "ctl_fill_disk", fill=False)
        assert await effects_of(client, "full") == []
        before = await verify(client, "full", "pay")
        paid = await client.call_tool("pay", {"amount": 1}, meta=keyed("full"))
        filled = await client.call_tool("leaky", {"payload": "p", "fill": True}, meta=keyed("f"))
        await ctl(client, "ctl_fill_disk", fill=False)
        after = await verify(client, "f", "leaky")
        assert len(await effects_of(client, "f")) == 1
    assert refused.value.code == REJECTED_CODE
    assert refused.value.error.data == {OUTCOME_DATA: "not_committed"}
    assert "could not record this call" in refused.value.message
    assert before["verdict"] == "not_committed" and not paid.is_error
    assert filled.is_error and "Error executing tool leaky" in str(filled.content)
    assert after["verdict"] == "unknown" and after["state"] == "in_progress", after


async def test_a_call_another_server_process_runs_is_in_flight_not_unseen(
    tmp_path: Path,
) -> None:
    """Two server processes on one file (a stdio server per client). The first holds
    an honest call before it recorded anything; the second was asked about its key and
    said "never saw the key: not_committed", and then the first committed it."""
    db = tmp_path / "effects.db"
    async with Client(stdio(db)) as first, Client(stdio(db)) as second:
        await ctl(first, "ctl_hold", point="body:stall")
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: first.call_tool("stall", {"payload": "p"}, meta=keyed("k")))
            assert await ctl(first, "ctl_reached", point="body:stall") == "k"
            during = await verify(second, "k", "stall")
            waited = await long_poll_over_release(second, "k", "stall", first, "body:stall")
        assert len(await effects_of(second, "k")) == 1
    assert during["state"] == "in_progress" and during["verdict"] == "unknown", during
    assert waited["verdict"] == "committed"


async def test_a_restart_between_call_and_verify_claims_no_more_than_the_file_holds(
    tmp_path: Path,
) -> None:
    """The first server process dies with two calls running and nothing recorded of
    either: ``leaky`` had made its effect, ``stall`` had not. Neither the server that
    was running beside it nor the one started after it knows its calls or which tools
    it distrusted; what they say rests on the file alone: both keys unknown (before:
    "never saw the key", not_committed, for an effect that happened). A key no call
    brought is still provably not committed, and the honest tool's key runs when
    called again."""
    db = tmp_path / "effects.db"
    async with Client(stdio(db)) as beside:
        with contextlib.suppress(Exception):  # the first's session ends with its process
            async with Client(stdio(db)) as first:
                await ctl(first, "ctl_hold", point="body:leaky")
                await ctl(first, "ctl_hold", point="body:stall")
                async with anyio.create_task_group() as tg:

                    async def call(tool: str, key: str, **arguments: Any) -> None:
                        with contextlib.suppress(Exception):  # no answer: the process died
                            arguments = {"payload": "p", **arguments}
                            await first.call_tool(tool, arguments, meta=keyed(key))

                    tg.start_soon(lambda: call("leaky", "acted", fail=False))
                    tg.start_soon(lambda: call("stall", "held"))
                    await ctl(first, "ctl_reached", point="body:leaky")
                    await ctl(first, "ctl_reached", point="body:stall")
                    await first.call_tool("ctl_die", {})
        answers = [await verify(beside, "acted", "leaky"), await verify(beside, "held", "stall")]
    async with Client(stdio(db)) as restarted:
        answers += [await verify(restarted, "acted", "leaky")]
        answers += [await verify(restarted, "held", "stall")]
        never = await verify(restarted, "never-sent", "leaky")
        truth = await ctl(restarted, "ctl_truth")
        again = await restarted.call_tool("stall", {"payload": "p"}, meta=keyed("held"))
        after = await verify(restarted, "held", "stall")
    assert [e["key"] for e in truth] == ["acted"]  # leaky acted; stall never did
    for answer in answers:
        assert answer["verdict"] == "unknown", answer
        assert "when its server process ended" in answer["detail"]
    assert never["verdict"] == "not_committed"  # no call brought it: provable
    assert not again.is_error and after["verdict"] == "committed"


@pytest.mark.parametrize("kind", ["stdio", "http"])
async def test_an_outside_client_gets_the_same_answers(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fastmcp``'s own ``Client`` (its transports, its negotiation): the same three
    endings read the same way."""
    from fastmcp.client import extension_hooks

    monkeypatch.setattr(extension_hooks, "_internal_client_extension_factories", [])  # plain
    db = tmp_path / "effects.db"

    async def answers(client: FastClient[Any]) -> list[str]:
        for tool, arguments, key in (
            ("pay", {"amount": "ten"}, "refused"),
            ("leaky", {"payload": "p"}, "leaked"),
            ("pay", {"amount": 1}, "paid"),
        ):
            await client.call_tool(tool, arguments, meta={KEY_META: key}, raise_on_error=False)
        verdicts = []
        for key, tool in (("refused", "pay"), ("leaked", "leaky"), ("paid", "pay")):
            result = await client.call_tool(VERIFY_TOOL, {"key": key, "tool": tool})
            assert isinstance(result.structured_content, dict)
            verdicts.append(result.structured_content["verdict"])
        return verdicts

    if kind == "stdio":
        transport = StdioTransport(
            sys.executable, [SERVER, "--db", str(db)], env=server_env(), cwd=str(ROOT)
        )
        async with FastClient(transport) as client:
            verdicts = await answers(client)
    else:
        with serve_http(SERVER, "--db", str(db)) as url:
            async with FastClient(url) as client:
                verdicts = await answers(client)
    assert verdicts == ["not_committed", "unknown", "committed"]


def test_a_file_from_before_keeps_its_marks_as_answers(tmp_path: Path) -> None:
    """A file written before ADR 0067 has no ``ending`` column: it is added, and its
    marks (all of calls that answered unrecorded) read as such."""
    path = tmp_path / "effects.db"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE stopline_unrecorded (key TEXT PRIMARY KEY, tool TEXT NOT NULL,"
            " at REAL NOT NULL)"
        )
        db.execute("INSERT INTO stopline_unrecorded VALUES ('k', 'misdeclared', 0)")
    db.close()
    seen = Effects(path).store.evidence("k")
    assert seen.record is None and not seen.arriving
    assert seen.unrecorded == Unrecorded("misdeclared", Ending.ANSWERED)
