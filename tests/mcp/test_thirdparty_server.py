"""The third-party-style MCP server (tests/support/thirdparty_mcp_server.py) does what
its docstring says, seen through the bare ``mcp`` SDK client on stdio and Streamable
HTTP in both protocol eras: its ground-truth log is what the truth matrix trusts."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from mcp import Client
from tests.support.thirdparty_mcp_server import (
    EFFECT_TOOLS,
    commits,
    http_server,
    log_entries,
    stdio_params,
)

pytestmark = pytest.mark.timeout(60)
TRANSPORTS = ["stdio-legacy", "stdio-2026", "http-legacy", "http-2026"]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("thirdparty") / "truth.jsonl"


@pytest.fixture(scope="module")
def http_url(log: Path) -> Iterator[str]:
    with http_server(log) as url:
        yield url


@pytest.fixture(scope="module", params=TRANSPORTS)
async def client(request: pytest.FixtureRequest, log: Path) -> AsyncIterator[Client]:
    kind, era = str(request.param).split("-")
    target: Any = stdio_params(log) if kind == "stdio" else request.getfixturevalue("http_url")
    async with Client(target, mode="legacy" if era == "legacy" else "2026-07-28") as opened:
        yield opened


async def ctl(client: Client, name: str, **arguments: Any) -> Any:
    result = await client.call_tool(name, arguments)
    assert not result.is_error, result
    return result.structured_content


def key_for(request: pytest.FixtureRequest, kind: str) -> str:
    """An idempotency key no other test of this module uses: the log and the HTTP server
    outlive a client, so a key must name the test (``id(client)`` may be reused once a
    client is freed, and would find the last client's payment)."""
    return f"{kind}-{request.node.callspec.id}"


async def cancel_at(client: Client, tool: str, key: str, at: str) -> dict[str, Any]:
    """Call ``tool``, cancel the call (the SDK's way) while the server holds it at ``at``."""
    await ctl(client, "ctl_hold", tool=tool, at=at)
    async with anyio.create_task_group() as tg:

        async def call() -> None:
            await client.call_tool(tool, {"idempotency_key": key, "amount": 3})

        tg.start_soon(call)
        assert (await ctl(client, "ctl_reached", tool=tool, at=at))["key"] == key
        tg.cancel_scope.cancel()
    if tool != "pay_cancellable":
        await ctl(client, "ctl_release", tool=tool, at=at)
    return dict(await ctl(client, "ctl_ended", idempotency_key=key))


@pytest.mark.parametrize("tool", EFFECT_TOOLS)
async def test_each_tool_commits_once_and_the_read_tool_finds_it(
    client: Client, log: Path, tool: str, request: pytest.FixtureRequest
) -> None:
    key = key_for(request, "plain")
    missing = await ctl(client, "find_payment", idempotency_key=key)
    assert missing == {"found": False, "payment": None, "count": 0}
    first = await ctl(client, tool, idempotency_key=key, amount=7)
    again = await ctl(client, tool, idempotency_key=key, amount=7)
    assert first == {"payment_id": key, "amount": 7, "replayed": False}
    assert again["replayed"] is True
    assert len(commits(log, key)) == 1
    found = await ctl(client, "find_payment", idempotency_key=key)
    assert found == {"found": True, "payment": {"payment_id": key, "amount": 7}, "count": 1}


@pytest.mark.parametrize("tool", EFFECT_TOOLS)
async def test_a_cancel_stops_only_the_cancellable_tool(
    client: Client, log: Path, tool: str, request: pytest.FixtureRequest
) -> None:
    key = key_for(request, "cancel")
    ended = await cancel_at(client, tool, key, "50")
    if tool == "pay_cancellable":
        assert ended == {"event": "stopped", "at": "50"}
        assert commits(log, key) == []
    else:
        assert ended["event"] == "commit"
        assert len(commits(log, key)) == 1


async def test_the_late_tool_ignores_the_cancel_notification(
    client: Client, log: Path, request: pytest.FixtureRequest
) -> None:
    """On stdio and 2025-era HTTP the cancel is a notification, which ``pay_late``
    drops (and logs); on 2026 HTTP the cancel is the stream close."""
    key = key_for(request, "late")
    await cancel_at(client, "pay_late", key, "25")
    ignored = [e for e in log_entries(log) if e["key"] == key and e["event"] == "cancel_ignored"]
    notification_era = "http-2026" not in request.node.callspec.id
    assert bool(ignored) is notification_era
