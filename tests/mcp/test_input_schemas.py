"""``StoplineMCP``'s check of a call's arguments against the tool's listed
``inputSchema`` (ADR 0116), on by default, against a Python server whose tools take
the idempotency key as an argument (``tests/support/thirdparty_mcp_server.py``): the
key the client adds is counted as present, a misfit is refused before the gate, and
``check_input_schemas=False`` leaves the server to judge."""

from __future__ import annotations

from pathlib import Path

import pytest

import stopline
from stopline.integrations.mcp import StoplineMCP, ToolPolicy
from tests.support.thirdparty_mcp_server import commits, stdio_params

pytestmark = pytest.mark.timeout(60)
POLICIES = {"pay_cancellable": ToolPolicy(key_argument="idempotency_key")}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def test_the_key_argument_counts_as_given_and_a_misfit_is_refused_before_the_gate(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    log = tmp_path / "truth.jsonl"
    target = stdio_params(log)
    async with (
        StoplineMCP(target, name="pay", policies=POLICIES) as conn,
        ledger.run("pay", owner="user:1", run_id="schemas") as run,
    ):
        with pytest.raises(stopline.InvalidInput, match="amount: 'five' is not of type"):
            await conn.call(run, "pay_cancellable", {"amount": "five"}, key="bad")
        assert await ledger.backend.operations(run.id) == []
        # the schema requires idempotency_key: the client sets it after the check
        paid = await conn.call(run, "pay_cancellable", {"amount": 5}, key="good")
    assert paid["payment_id"] == "schemas/good"
    assert len(commits(log, "schemas/good")) == 1


async def test_with_the_check_off_the_arguments_go_to_the_server(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The server judges them: its refusal is a tool error, ``unknown``, recorded."""
    target = stdio_params(tmp_path / "truth.jsonl")
    async with (
        StoplineMCP(target, name="pay", policies=POLICIES, check_input_schemas=False) as conn,
        ledger.run("pay", owner="user:1") as run,
    ):
        with pytest.raises(stopline.NoAnswer):
            await conn.call(run, "pay_cancellable", {"amount": "five"}, key="bad")
        (op,) = await ledger.backend.operations(run.id)
    assert op.status in (stopline.OpStatus.UNKNOWN, stopline.OpStatus.NEEDS_REVIEW)
