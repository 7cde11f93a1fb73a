"""A cancel names a request of the client that sent it, and of no other.

JSON-RPC request ids are chosen by each client, so two clients of one HTTP
server send the same ids. The server's cancellation log matched a
``notifications/cancelled`` by id alone: a second session's cancel was logged
against the first session's call in flight, and marked that call's cancel
``refused``, which its client's receipt then reports. Tested over Streamable
HTTP (the session header) and SSE (the session in the query) with two raw SDK
clients of the real testing server; the client's own cancel still counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import anyio
import pytest
from mcp.client.sse import sse_client
from mcp_types import CancelledNotification, CancelledNotificationParams, RequestParamsMeta

from mcp import Client
from stopline.integrations.mcp import KEY_META, VERIFY_TOOL
from tests.mcp.conftest import serve_http

pytestmark = pytest.mark.timeout(60)
KIND = ["streamable-http", "sse"]
FOREIGN = "from the other session"


@pytest.fixture(scope="module", params=KIND)
def url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    db = str(tmp_path_factory.mktemp("peers") / "effects.db")
    sse = ["--sse"] if request.param == "sse" else []
    with serve_http("-m", "stopline.integrations.mcp.testing", "--db", db, *sse) as base:
        yield base.removesuffix("/mcp") + "/sse" if sse else base


@contextlib.asynccontextmanager
async def client(url: str) -> AsyncIterator[Client]:
    transport: Any = sse_client(url) if url.endswith("/sse") else url
    async with Client(transport, mode="legacy") as opened:
        yield opened


async def ctl(c: Client, name: str, **arguments: Any) -> Any:
    result = await c.call_tool(name, arguments)
    assert not result.is_error, result
    assert result.structured_content is not None
    return result.structured_content.get("result", result.structured_content)


async def cancel_ids(c: Client, ids: range) -> None:
    """``notifications/cancelled`` for every id in ``ids``, as this client's session."""
    for rid in ids:
        params = CancelledNotificationParams(request_id=rid, reason=FOREIGN)
        await c.session.send_notification(CancelledNotification(params=params))


async def test_a_cancel_from_another_session_names_none_of_this_sessions_calls(url: str) -> None:
    key = f"peers-{url.rsplit('/', 1)[-1]}"
    async with client(url) as a, client(url) as b:
        await ctl(a, "ctl_hold", point="accepted:deploy")
        scope = anyio.CancelScope()  # the first session's own cancel, later
        async with anyio.create_task_group() as tg:

            async def deploy() -> None:
                with scope:
                    meta = cast(RequestParamsMeta, {KEY_META: key})
                    await a.call_tool("deploy", {"payload": "x"}, meta=meta)

            tg.start_soon(deploy)
            assert (await ctl(a, "ctl_reached", point="accepted:deploy"))["key"] == key
            await cancel_ids(b, range(32))  # every id the first session may have used
            foreign: list[dict[str, Any]] = []
            while len(foreign) < 32:  # each is logged as the server handles it
                truth = await ctl(a, "ctl_truth")
                foreign = [
                    c for c in truth["cancellations"] if c["reason"] == "from the other session"
                ]
            assert {(c["key"], c["state"]) for c in foreign} == {(None, "finished_or_unknown")}
            assert (await ctl(a, VERIFY_TOOL, key=key))["cancel"] == "none"

            scope.cancel()  # the SDK sends the first session's own notifications/cancelled
            while (await ctl(a, VERIFY_TOOL, key=key))["cancel"] != "refused":
                await ctl(a, VERIFY_TOOL, key=key, wait_seconds=0.05)
            await ctl(a, "ctl_release", point="accepted:deploy")
        log = [c for c in (await ctl(a, "ctl_truth"))["cancellations"] if c["key"] == key]
        assert [(c["via"], c["tool"], c["state"]) for c in log] == [
            ("notification", "deploy", "accepted")
        ]
