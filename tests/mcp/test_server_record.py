"""The server-side ``Effects`` record keeps what a tool returns, and never records
``not_committed`` once a commit began (tests/support/recorded_server.py over stdio).

A tool's result went through ``json.dumps`` after its effect: a ``datetime`` or a
pydantic model failed there, the async path recorded ``not_committed`` and told
the client so, and a retry with the same key committed a second time.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from mcp_types import RequestParamsMeta

import stopline
from mcp import Client, MCPError, StdioServerParameters
from stopline import OpStatus
from stopline.integrations.mcp import KEY_META, OUTCOME_DATA, VERIFY_TOOL, StoplineMCP
from tests.mcp.conftest import ROOT, server_env

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
    return result.structured_content["result"]


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
