"""Odd input to a stopline server, from a client stopline did not write (the official
``mcp`` SDK's ``Client``, real stdio and Streamable HTTP).

- Idempotency keys the ledger refuses as ids (``check_id``: over 1024 characters, a
  control character, NUL among them) were accepted and kept: a 2 MB key was written
  whole into the record, every state change of its call rewriting it. They are refused
  before any effect (``not_committed``), and ``stopline_verify`` names the key as the
  problem (-32602). A key that is no string at all is what it was: no key.
- A verify asked while a call of the key is running waits for it (``wait_seconds``),
  or says it is in progress; never "not committed".
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import anyio
import pytest
from mcp_types import INVALID_PARAMS, RequestParamsMeta

from mcp import MCPError
from stopline.integrations.mcp import KEY_META, OUTCOME_DATA, REJECTED_CODE, VERIFY_TOOL
from tests.mcp.conftest import TRANSPORTS
from tests.mcp.test_server_edges_tracking import (
    ctl,
    edges,
    effects_of,
    keyed,
    long_poll_over_release,
    verify,
)

pytestmark = pytest.mark.timeout(90)

UNUSABLE = ["k" * 1025, "k" * 2_000_000, "a\x00b", "a\x1bb", "line\nbreak"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("transport", ["stdio-legacy", "http-2026"])
async def test_a_key_no_record_should_hold_is_refused_before_any_effect(
    tmp_path: Path, transport: str
) -> None:
    async with edges(transport, tmp_path / "effects.db") as client:
        for key in UNUSABLE:
            with pytest.raises(MCPError) as refused:
                await client.call_tool("pay", {"amount": 1}, meta=keyed(key))
            assert refused.value.code == REJECTED_CODE
            assert refused.value.error.data == {OUTCOME_DATA: "not_committed"}
            assert await effects_of(client, key) == []  # before: committed, key and all
            with pytest.raises(MCPError) as asked:
                await client.call_tool(VERIFY_TOOL, {"key": key, "tool": "pay"})
            assert asked.value.code == INVALID_PARAMS and "invalid key" in asked.value.message
        longest = "k" * 1024  # the longest id the ledger takes
        assert not (await client.call_tool("pay", {"amount": 1}, meta=keyed(longest))).is_error
        assert (await verify(client, longest, "pay"))["verdict"] == "committed"


@pytest.mark.parametrize("transport", ["stdio-2026", "http-legacy"])
async def test_a_key_that_is_no_string_is_no_key(tmp_path: Path, transport: str) -> None:
    async with edges(transport, tmp_path / "effects.db") as client:
        for key in (5, None, ["k"], {"k": 1}, True):
            meta = cast(RequestParamsMeta, {KEY_META: key})
            with pytest.raises(MCPError, match="needs an idempotency key") as refused:
                await client.call_tool("pay", {"amount": 1}, meta=meta)
            assert refused.value.error.data == {OUTCOME_DATA: "not_committed"}
        asked = await client.call_tool(VERIFY_TOOL, {"key": 5, "tool": "pay"})
        assert asked.is_error  # the SDK's own check of the verify's arguments
        assert await ctl(client, "ctl_truth") == []


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_verify_during_a_call_waits_for_it_or_says_it_runs(
    tmp_path: Path, transport: str
) -> None:
    """``pay`` is held in its body before it records anything; the same client asks."""
    async with edges(transport, tmp_path / "effects.db") as client:
        await ctl(client, "ctl_hold", point="body:pay")
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: client.call_tool("pay", {"amount": 1}, meta=keyed("during")))
            assert await ctl(client, "ctl_reached", point="body:pay") == "during"
            now = await verify(client, "during", "pay")
            waited = await long_poll_over_release(client, "during", "pay", client, "body:pay")
    assert now["state"] == "in_progress" and now["verdict"] == "unknown", now
    assert waited["verdict"] == "committed"
