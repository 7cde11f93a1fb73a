"""ADR 0063: ``stopline_verify`` claims "not committed" for a key it has no record of
only for a tool whose every call the server records (``io.stopline/tracked``).

The testing server (``stopline.integrations.mcp.testing``, real processes over stdio
and Streamable HTTP) holds ``upload`` (tracked: recorded through ``Effects``),
``echo`` and ``unrecorded`` (effects the record does not hold) and ``misdeclared``
(declares tracked, records nothing). Before ADR 0063 the server answered "never saw
the key: not_committed" for a key ``echo`` had answered, and ``StoplineMCP`` took that
answer as the read-back of a cut call to such a tool: a receipt claiming that an
effect which happened did not.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from mcp_types import INVALID_PARAMS, RequestParamsMeta

import stopline
from mcp import MCPError
from stopline import OpStatus
from stopline.errors import InvalidInput
from stopline.integrations.mcp import KEY_META, TRACKED_META, VERIFY_TOOL, Effects
from tests.conftest import FAST_VERIFY
from tests.mcp.conftest import TRANSPORTS, Server, cut_under_immediate, open_server, serve_http


@pytest.fixture(params=TRANSPORTS)
async def server(
    request: pytest.FixtureRequest, tmp_path: Path, http_url: str
) -> AsyncIterator[Server]:
    async for opened in open_server(request.param, tmp_path, http_url):
        yield opened


@pytest.fixture(params=TRANSPORTS)
async def fresh_server(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Server]:
    """A server process of its own (what it learns of its tools is its own)."""
    db = str(tmp_path / "fresh.db")
    with serve_http("-m", "stopline.integrations.mcp.testing", "--db", db) as url:
        async for opened in open_server(request.param, tmp_path, url):
            yield opened


def keyed(key: str) -> RequestParamsMeta:
    return cast(RequestParamsMeta, {KEY_META: key})


async def verify(server: Server, key: str, **arguments: Any) -> dict[str, Any]:
    """The server's ``stopline_verify`` answer, asked over the raw SDK client."""
    result = await server.conn.client.call_tool(VERIFY_TOOL, {"key": key, **arguments})
    assert not result.is_error and isinstance(result.structured_content, dict), result
    return result.structured_content


async def test_the_listing_says_which_tools_the_record_holds(server: Server) -> None:
    listing = server.conn.listing
    meta = {name: listing[name].meta or {} for name in ("upload", "echo", "unrecorded")}
    assert meta["upload"].get(TRACKED_META) is True  # effect_meta(): recorded through Effects
    assert TRACKED_META not in meta["echo"] and TRACKED_META not in meta["unrecorded"]
    assert server.conn.policy("upload").tracked is True
    assert server.conn.policy("unrecorded").tracked is None
    schema = listing[VERIFY_TOOL].input_schema.get("properties", {})
    assert "tool" in schema


async def test_a_key_an_unrecorded_tool_answered_is_not_claimed_not_committed(
    server: Server,
) -> None:
    """The probe's reproduction: ``echo`` ran for the key, the record holds nothing."""
    key = f"echo-ran-{server.transport}"
    echoed = await server.conn.client.call_tool("echo", {"payload": "hi"}, meta=keyed(key))
    assert echoed.structured_content == {"value": "hi"}  # it ran
    named = await verify(server, key, tool="echo")
    assert named["verdict"] == "unknown" and named["tracked"] is False
    assert named["tool"] == "echo" and "proves nothing" in named["detail"]
    # a client from before ADR 0063 names no tool: this server has untracked effectful
    # tools, so its "no record" proves nothing for any of them
    unnamed = await verify(server, key)
    assert unnamed["verdict"] == "unknown" and unnamed["tracked"] is False
    assert "verify named no tool" in unnamed["detail"]
    # the client's own read of it, the tool named
    status = await server.conn.status(key, tool="echo")
    assert status["verdict"] == "unknown"


async def test_not_found_is_claimed_only_where_the_key_would_be_recorded(
    server: Server,
) -> None:
    never = f"never-sent-{server.transport}"
    tracked = await verify(server, never, tool="upload")
    assert tracked["verdict"] == "not_committed" and tracked["tracked"] is True
    assert tracked["state"] == "unknown_key"
    for tool in ("echo", "unrecorded", "no_such_tool", "lookup"):
        answer = await verify(server, never, tool=tool)
        assert answer["verdict"] == "unknown", (tool, answer)
        assert answer["tracked"] is False


async def test_a_request_refused_for_its_arguments_stays_not_committed_and_reusable(
    server: Server,
) -> None:
    """What a naive fix broke: a tracked tool's request refused before its body ran
    (bad arguments) left no record; it is ``not_committed``, not in doubt, and a later
    call with the same key runs."""
    key = f"bad-arguments-{server.transport}"
    client = server.conn.client
    refused = await client.call_tool("upload", {"payload": 5}, meta=keyed(key))
    assert refused.is_error
    assert (await verify(server, key, tool="upload"))["verdict"] == "not_committed"
    again = await client.call_tool("upload", {"payload": "r"}, meta=keyed(key))
    assert not again.is_error
    assert (await verify(server, key, tool="upload"))["verdict"] == "committed"
    assert len(await server.effects_of(key)) == 1


async def test_a_tool_declared_tracked_that_records_nothing_is_tracked_no_more(
    fresh_server: Server,
) -> None:
    """``misdeclared`` promises ``io.stopline/tracked`` and records nothing: the server
    believes the promise until it sees the tool answer a call unrecorded, then answers
    ``unknown`` for that key and for every key of that tool."""
    server = fresh_server
    before = f"misdeclared-before-{server.transport}"
    ran = f"misdeclared-ran-{server.transport}"
    after = f"misdeclared-after-{server.transport}"
    assert (await verify(server, before, tool="misdeclared"))["verdict"] == "not_committed"
    result = await server.conn.client.call_tool("misdeclared", {"payload": "x"}, meta=keyed(ran))
    assert not result.is_error and len(await server.effects_of(ran)) == 1
    seen = await verify(server, ran, tool="misdeclared")
    assert seen["verdict"] == "unknown" and "without recording it" in seen["detail"]
    later = await verify(server, after, tool="misdeclared")
    assert later["verdict"] == "unknown" and later["tracked"] is False
    # the record of a tool that keeps its promise is untouched
    assert (await verify(server, after, tool="upload"))["verdict"] == "not_committed"


@pytest.mark.parametrize("wait", [-1, -0.001, 30.001, 1e9])
async def test_a_wait_out_of_range_is_refused_naming_it(server: Server, wait: float) -> None:
    with pytest.raises(MCPError) as refused:
        await server.conn.client.call_tool(VERIFY_TOOL, {"key": "k", "wait_seconds": wait})
    assert refused.value.code == INVALID_PARAMS
    assert "wait_seconds" in refused.value.message and "0 to 30" in refused.value.message
    # the client refuses it before anything is sent
    with pytest.raises(InvalidInput, match="wait_seconds"):
        await server.conn.status("k", wait_seconds=wait, tool="upload")
    for edge in (0, 30):  # the range's ends are waits
        answer = await verify(server, f"edge-{edge}", tool="upload", wait_seconds=edge)
        assert answer["verdict"] == "not_committed"


async def test_the_record_refuses_a_wait_that_is_no_number(tmp_path: Path) -> None:
    effects = Effects(tmp_path / "effects.db")
    for wait in (math.nan, math.inf, -1, "5", True, None):
        with pytest.raises(InvalidInput, match="wait_seconds"):
            await effects.status("k", wait_seconds=wait)  # type: ignore[arg-type]


async def test_a_cut_call_to_an_unrecorded_tool_is_never_settled_not_committed(
    server: Server, tmp_path: Path
) -> None:
    """End to end through ``StoplineMCP``: the tool commits, the call is cut (an
    ``immediate`` cancel) before its answer, the server's ``stopline_verify`` is the
    read-back. The receipt must not say the effect did not happen."""
    point = "committed:unrecorded"
    await server.hold(point)
    async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger:
        receipt, op = await cut_under_immediate(
            ledger,
            f"cut-unrecorded-{server.transport}",
            lambda run: server.conn.call(run, "unrecorded", {"payload": "p"}, key="call"),
            lambda: server.reached(point),  # the effect is in the providers' truth
            lambda: server.release(point),
        )
    key = op.id
    assert len(await server.effects_of(key)) == 1  # it happened
    # before ADR 0063: not_committed, on the server's "never saw the key"
    assert op.status is OpStatus.NEEDS_REVIEW, receipt.text()
    assert "outcome unknown" in receipt.text()


async def test_a_key_answered_unrecorded_reads_unknown_in_every_server_on_the_file(
    tmp_path: Path,
) -> None:
    """The mark is durable: a second server process on the same file (a stdio server
    per client) answers ``unknown`` for the key too."""
    async for first in open_server("stdio-legacy", tmp_path):
        ran = "misdeclared-two-processes"
        await first.conn.client.call_tool("misdeclared", {"payload": "x"}, meta=keyed(ran))
        async for second in open_server("stdio-legacy", tmp_path):
            seen = await verify(second, ran, tool="misdeclared")
    assert seen["verdict"] == "unknown" and "without recording it" in seen["detail"]
