"""R11 under attack: stopline's own principal cannot be forged; no tenant means no tenant.

Every governed action (cancel, pause, resume, approve, deny, compensate, stop a
compensation, resolve a review) and the read (a receipt) is tried by a bare
principal and by a forged "stopline" against another tenant's run; the CLI and
the console act as operators and cannot act as stopline either.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from starlette.testclient import TestClient

import stopline
from stopline import Principal, RunState
from stopline.console import ConsoleConfig, create_app
from stopline.errors import NotPermitted, UnknownRun
from stopline.ledger.backend import RunSpec
from stopline.testing import FakeProvider
from tests.surfaces.test_cli import stopline_cli

Act = Callable[[stopline.Ledger, dict[str, str], Any], Awaitable[Any]]

ACTIONS: dict[str, Act] = {
    "cancel": lambda ledger, ids, by: ledger.cancel(ids["run"], by=by),
    "pause": lambda ledger, ids, by: ledger.pause(ids["run"], by=by),
    "resume": lambda ledger, ids, by: ledger.resume(ids["run"], by=by),
    "approve": lambda ledger, ids, by: ledger.approve(ids["approval"], by=by),
    "deny": lambda ledger, ids, by: ledger.deny(ids["approval"], by=by),
    "compensate": lambda ledger, ids, by: ledger.compensate(ids["op"], by=by),
    "stop_compensation": lambda ledger, ids, by: ledger.stop_compensation(ids["op"], by=by),
    "resolve_review": lambda ledger, ids, by: ledger.resolve_review(ids["op"], "committed", by=by),
    "receipt": lambda ledger, ids, by: ledger.receipt(ids["run"], by=by),
}


async def tenant_run(ledger: stopline.Ledger, tenant: str, run_id: str) -> dict[str, str]:
    """A run of ``tenant`` with one committed operation and an approval asked for."""
    provider = FakeProvider("send", compensable=True)
    ledger.register_tool(provider.tool)
    async with ledger.run("job", owner="owner:1", tenant=tenant, run_id=run_id) as run:
        await run.call(provider.tool, "x", key="send")
        approval = await run.request_approval("pay", approver="owner:1")
    return {"run": run_id, "op": f"{run_id}/send", "approval": approval.id}


@pytest.mark.parametrize("action", sorted(ACTIONS))
@pytest.mark.parametrize("who", ["stopline", "user:1", Principal("stopline", tenant="*")])
async def test_a_bare_or_forged_principal_cannot_touch_another_tenants_run(
    tmp_path: Path, action: str, who: str | Principal
) -> None:
    async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        ids = await tenant_run(ledger, "acme", "run_acme")
        before = [(e.kind, e.op_id) for e in await ledger.backend.events("run_acme")]
        with pytest.raises((UnknownRun, NotPermitted)):
            await ACTIONS[action](ledger, ids, who)
        after = await ledger.backend.events("run_acme")
        run = await ledger.backend.get_run("run_acme")
    assert run.state is RunState.COMPLETED
    changed = [(e.kind, e.op_id) for e in after][len(before) :]
    assert all(kind == "denied" for kind, _ in changed)  # only the refusal was recorded


async def test_a_forged_stopline_is_refused_even_in_its_own_tenant(tmp_path: Path) -> None:
    async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        async with ledger.run("job", owner="user:1", run_id="run_1"):
            for forged in ("stopline", Principal("stopline", roles=frozenset({"system"}))):
                with pytest.raises((UnknownRun, NotPermitted)):  # it sees nothing, may nothing
                    await ledger.cancel("run_1", by=forged)
            receipt = await ledger.cancel("run_1", by="user:1")  # the owner may
        assert receipt.run_id == "run_1"
        settled = await ledger.wait_settled("run_1", timeout=30)  # stopline's own settling
    assert settled.run_state is RunState.CANCELLED


async def test_a_principal_without_a_tenant_sees_only_runs_without_one(tmp_path: Path) -> None:
    async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        async with ledger.run("job", owner="user:1", run_id="run_plain"):
            pass
        async with ledger.run("job", owner="user:1", tenant="acme", run_id="run_acme"):
            pass
        assert (await ledger.receipt("run_plain", by="user:1")).run_id == "run_plain"
        with pytest.raises(UnknownRun):
            await ledger.receipt("run_acme", by="user:1")  # its owner's id, another tenant
        with pytest.raises(UnknownRun):
            await ledger.cancel("run_acme", by="user:1")
        member = Principal("user:1", tenant="acme")
        assert (await ledger.receipt("run_acme", by=member)).run_id == "run_acme"


def test_the_cli_acts_as_an_operator_never_as_stopline(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"

    async def seed() -> None:
        async with stopline.open(url) as ledger:
            for run_id in ("run_a", "run_b"):  # running: a worker elsewhere holds them
                await ledger.backend.create_run(RunSpec(run_id, "job", "owner:1", "acme"))

    anyio.run(seed)
    forged = stopline_cli("cancel", "run_a", "--by", "stopline", ledger=url)
    # refused as the usage error it is, before the ledger is opened (it was refused as
    # "unknown run id" once the ledger had logged the refusal): nothing written
    assert forged.returncode == 2
    assert "stopline's own principal" in forged.stderr
    done = stopline_cli("cancel", "run_b", "--by", "ops:ada", "--json", ledger=url)
    assert done.returncode in (0, 3), done.stderr  # 3: settling is up to its worker

    async def trail() -> tuple[list[Any], list[Any]]:
        async with stopline.open(url) as ledger:
            return await ledger.backend.events("run_a"), await ledger.backend.events("run_b")

    events_a, events_b = anyio.run(trail)
    assert [e.kind for e in events_a if e.kind in ("denied", "cancel")] == []
    assert [e.data["by"] for e in events_b if e.kind == "cancel"] == ["ops:ada"]


def test_the_console_acts_as_its_session_principal(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"

    async def seed() -> None:
        async with stopline.open(url) as ledger:
            await ledger.backend.create_run(RunSpec("run_a", "job", "owner:1", "acme"))

    anyio.run(seed)
    app = create_app(ConsoleConfig(url=url, token="tok"))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get("/?token=tok&name=stopline")  # a session may not become stopline
        page = client.get("/runs/run_a")
        assert page.status_code == 200  # an operator reads every tenant's runs
        csrf = page.text.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        done = client.post("/runs/run_a/cancel", data={"csrf": csrf, "reason": "r"})
        assert done.status_code == 200

    async def trail() -> list[Any]:
        async with stopline.open(url) as ledger:
            return await ledger.backend.events("run_a")

    cancels = [e.data["by"] for e in anyio.run(trail) if e.kind == "cancel"]
    assert cancels == ["console:stopline"]  # recorded as the console's principal
