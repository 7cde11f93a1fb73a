"""A long-lived process: typed errors for misuse, options kept, per-run state bounded."""

from __future__ import annotations

from collections.abc import Sized
from pathlib import Path

import anyio
import pytest

import stopline
from stopline import Cancellable, Policy
from stopline.errors import AlreadyAttached
from stopline.telemetry import Telemetry
from stopline.testing import FakeProvider
from tests.conftest import FAST_VERIFY
from tests.truth.helpers import quiesce


async def test_attaching_a_run_twice_in_one_process_is_a_typed_error(tmp_path: Path) -> None:
    async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        async with ledger.run("job", owner="u", run_id="run_1") as run:
            with pytest.raises(AlreadyAttached, match="run_1"):
                async with ledger.run("job", owner="u", run_id="run_1"):
                    pass
            await run.call(FakeProvider("send").tool, "still attached once")
        receipt = await ledger.receipt("run_1")
    assert receipt.run_state.value == "completed"


async def test_a_telemetry_observer_keeps_durable_outcomes_off(tmp_path: Path) -> None:
    provider = FakeProvider("send")
    telemetry = Telemetry()
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with stopline.open(url, observers=[telemetry], durable_outcomes=False) as ledger:
        assert ledger.backend.defers_outcomes  # the option reached the backend it wraps
        assert ledger.backend.location == url.replace("sqlite:///", "sqlite:///")
        async with ledger.run("job", owner="u", run_id="run_1") as run:
            await run.call(provider.tool, "x", key="x")
        receipt = await ledger.wait_settled("run_1", timeout=30)
    assert [line.status.value for line in receipt.lines] == ["committed"]
    assert telemetry.ops == {}  # the deferred outcome was observed and its span ended


async def test_per_run_state_is_dropped_when_runs_settle(tmp_path: Path) -> None:
    """Many runs through one ledger (completed, cancelled, verified, failed to verify):
    nothing is left in any per-run or per-operation map afterwards."""
    telemetry = Telemetry()
    lossy = FakeProvider("lossy", drop_response=True, cancellable=Cancellable.NEVER)
    sender = FakeProvider("send")
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with stopline.open(url, observers=[telemetry], verify=FAST_VERIFY) as ledger:
        for i in range(30):
            run_id = f"run_{i}"
            async with ledger.run("job", owner="u", run_id=run_id, policy=Policy.AT_BOUNDARY) as r:
                await r.call(sender.tool, i, key="send")
                if i % 3 == 0:
                    with pytest.raises(ConnectionResetError):
                        await r.call(lossy.tool, i, key="lossy")  # unknown: read back
                if i % 2 == 0:
                    await ledger.cancel(run_id, by="u")
            await ledger.wait_settled(run_id, timeout=30)
        await quiesce(ledger)  # background steps still finishing their bookkeeping
        core = ledger.core
        settler = core.settler
        maps: dict[str, Sized] = {
            "local runs": core.runs,
            "change events": core._changes,
            "held outcomes": core.outbox.held,
            "settler wanted": settler._wanted,
            "verifying": settler._verifying,
            "held steps": settler._held,
            "telemetry runs": telemetry.runs,
            "telemetry ops": telemetry.ops,
            "telemetry linked": telemetry.linked,
        }
        sizes = {name: len(m) for name, m in maps.items()}
    assert sizes == dict.fromkeys(maps, 0)


async def test_a_verifier_that_raises_leaves_its_error_in_the_ledger(tmp_path: Path) -> None:
    lossy = FakeProvider("lossy", drop_response=True, cancellable=Cancellable.NEVER)

    async def broken_verifier(ctx: stopline.CallContext) -> stopline.ReadBack:
        raise ConnectionRefusedError("verifier endpoint down")

    lossy.tool.verify_fn = broken_verifier
    async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger:
        async with ledger.run("job", owner="u", run_id="run_1") as run:
            with pytest.raises(ConnectionResetError):
                await run.call(lossy.tool, "x", key="x")
        with anyio.fail_after(30):
            op = await ledger.verify("run_1/x")
        events = await ledger.backend.events("run_1")
    assert op.status.value == "unknown"
    failures = [e for e in events if e.kind == "verify_failed"]
    assert failures
    assert "ConnectionRefusedError: verifier endpoint down" in str(failures[0].data)
