"""The server's own tool listing behind ``stopline_verify`` (ADR 0067): read once, read
again only after the server's tools changed, never believed weaker than before.

Before, every verify (and every keyed call's answer) ran the server's ``list_tools``
again: a cost that grows with the number of tools, paid per verify. Caching it must
not make an answer stale, nor may a tool that ran untracked be believed when it is
declared tracked later. The official ``mcp`` SDK's client, real stdio and real
Streamable HTTP, both eras.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stopline.integrations.mcp import Effects
from stopline.integrations.mcp.testing import build_server
from tests.mcp.conftest import TRANSPORTS
from tests.mcp.test_server_edges_tracking import ctl, edges, effects_of, keyed, verify

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_listing_is_read_again_only_after_the_tools_changed(
    tmp_path: Path, transport: str
) -> None:
    async with edges(transport, tmp_path / "effects.db") as client:
        assert (await verify(client, "first", "pay"))["verdict"] == "not_committed"
        before = await ctl(client, "ctl_listings")
        for i in range(10):  # verifies, and keyed calls of a tracked tool
            await verify(client, f"k{i}", "no_such_tool")
            assert not (await client.call_tool("pay", {"amount": 1}, meta=keyed(f"p{i}"))).is_error
        between = await ctl(client, "ctl_listings")
        await ctl(client, "ctl_redeclare", tool="pay", tracked=False)
        changed = await verify(client, "first", "pay")  # the change is seen at once
    assert between == before  # before ADR 0067: 20 more
    assert changed["verdict"] == "unknown" and changed["tracked"] is False
    assert "does not record calls of tool 'pay'" in changed["detail"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_tool_declared_tracked_after_it_ran_untracked_is_not_believed(
    tmp_path: Path, transport: str
) -> None:
    """``leaky`` is declared untracked and answers a call (its effect, no record, no
    trace: an untracked tool's calls are not followed); then it is declared tracked
    again. Its key must not read "not committed"."""
    async with edges(transport, tmp_path / "effects.db") as client:
        await ctl(client, "ctl_redeclare", tool="leaky", tracked=False)
        ran = await client.call_tool("leaky", {"payload": "p", "fail": False}, meta=keyed("u"))
        assert not ran.is_error and len(await effects_of(client, "u")) == 1
        await ctl(client, "ctl_redeclare", tool="leaky", tracked=True)
        answer = await verify(client, "u", "leaky")
    assert answer["verdict"] == "unknown", answer  # before: not_committed
    assert answer["tracked"] is False


async def test_one_record_follows_one_server(tmp_path: Path) -> None:
    """Installed again on its server, nothing changes; on another server the record
    would answer by the first one's tools: refused."""
    server, effects, _ = build_server(str(tmp_path / "effects.db"))
    verify_tools = [t for t in await server.list_tools() if t.name == "stopline_verify"]
    effects.install(server)
    assert [t for t in await server.list_tools() if t.name == "stopline_verify"] == verify_tools
    assert server.middleware.count(effects.middleware) == 1
    other, _, _ = build_server(str(tmp_path / "other.db"))
    with pytest.raises(Exception, match="installed on another server"):
        effects.install(other)
    assert isinstance(effects, Effects)
