"""R14 for an MCP call cut under ``immediate``: the cut itself tells the server.

Cutting the awaiting scope of an MCP call makes the SDK send
``notifications/cancelled`` (stdio, legacy HTTP) or close the stream (2026 HTTP).
For a tool whose policy says it must never be asked, the record must not say
"never asked" when the server's own cancellation log shows the cancel arrived.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import stopline
from stopline import CancelState, PhaseKind, Policy
from stopline.integrations.mcp import StoplineMCP
from stopline.integrations.mcp._store import EffectStore
from tests.conftest import FAST_VERIFY
from tests.support.thirdparty_mcp_server import commits, stdio_params
from tests.support.truth_matrix import ctl, policies


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_r14_a_cut_never_cancellable_mcp_call_is_recorded_as_asked(tmp_path: Path) -> None:
    log, effects = tmp_path / "truth.jsonl", tmp_path / "effects.db"
    where = stdio_params(log, "--stopline-effects", str(effects))
    tool = "pay_uncancellable"  # its _meta: cancellable=never
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        StoplineMCP(where, mode="legacy", name="pay", policies=policies()) as conn,
    ):
        run_id, key = "r14-cut", "r14-cut/pay"
        await ctl(conn.client, "ctl_hold", tool=tool, at="50", idempotency_key=key)

        async def workflow() -> None:
            async with (
                ledger.run("pay", owner="user:1", run_id=run_id) as run,
                run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),
            ):
                await conn.call(run, tool, {"amount": 5}, key="pay")

        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow)
            await ctl(conn.client, "ctl_reached", tool=tool, at="50", idempotency_key=key)
            await ledger.cancel(run_id, by="user:1")  # immediate: the call is cut
            await ctl(conn.client, "ctl_release", tool=tool, at="50", idempotency_key=key)
        receipt = await ledger.wait_settled(run_id, timeout=60)
        await ctl(conn.client, "ctl_ended", idempotency_key=key)
        op = (await ledger.backend.operations(run_id))[0]
        events = await ledger.backend.events(run_id)
    seen = [c for c in EffectStore(effects).cancellations() if c["key"] == key]
    assert [c["via"] for c in seen] == ["notification"]  # the server was told, by the cut
    assert op.cancel_state is CancelState.ASKED
    asked = [e for e in events if e.kind == "cancel_asked"]
    assert [e.data.get("channel") for e in asked] == ["notifications/cancelled"]
    assert len(commits(log, key)) == 1  # it could not cancel: it committed
    assert "never asked" not in receipt.text()
