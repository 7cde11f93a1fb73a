"""PostgreSQL connections killed at every step, and the server restarted: work finishes.

``pg_terminate_backend`` ends every connection of this test's schema (the
pool's and the LISTEN one) right before each step of a workflow; a restart
of the server (one test, quick and tolerant: others share the server) ends
them all at once. After each: no hang, nothing cancelled that nobody
cancelled, only typed errors, the contract's rules hold.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

import stopline
from stopline import Policy, RunState
from stopline.testing import FakeProvider
from stopline.testing.checks import Observed, check
from tests.postgres.server import server_url

pytestmark = pytest.mark.timeout(90)
STEPS = ("open", "create", "gate", "outcome", "cancel", "settle")


def terminate(schema: str) -> int:
    """End every server connection of this schema's ledger; how many there were."""
    with psycopg.connect(server_url(), autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE pid <> pg_backend_pid() AND (application_name = %s OR query LIKE %s)",
            (f"i13_{schema}", f"%stopline_cancel_{schema}%"),
        ).fetchall()
    return len(rows)


async def judge(ledger: stopline.Ledger, run_id: str, providers: dict[str, Any]) -> list[str]:
    settled = await ledger.wait_settled(run_id, timeout=60)
    seen = Observed(
        run=await ledger.backend.get_run(run_id),
        ops=await ledger.backend.operations(run_id),
        events=await ledger.backend.events(run_id),
        receipt=settled,
        settled=True,
        providers=providers,
        settled_receipt=settled,
    )
    return [str(v) for v in check(seen)[0]]


@pytest.mark.parametrize("step", STEPS)
async def test_every_connection_killed_at_each_step(pg_url: str, step: str) -> None:
    schema = pg_url.rsplit("schema=", 1)[1]
    url = f"{pg_url}&application_name=i13_{schema}&retry_for=10"
    send = FakeProvider("send")
    killed: list[int] = []

    async def kill_at(now: str) -> None:
        if now == step:
            killed.append(await anyio.to_thread.run_sync(terminate, schema))

    async def send_killing(payload: str) -> str:  # the outcome is recorded after this
        await kill_at("outcome")
        return payload

    async with stopline.open(url) as ledger:
        await kill_at("open")
        async with ledger.run("other", owner="u", run_id="run_other") as other:
            await kill_at("create")
            async with ledger.run("job", owner="u", run_id="run_1", policy=Policy.AT_BOUNDARY):
                pass
            async with ledger.run("job", owner="u", run_id="run_2", policy=Policy.AT_BOUNDARY) as r:
                await kill_at("gate")
                await r.call(send.tool, "a", key="a")
                await r.call(send_killing, "b", key="b")
                await kill_at("cancel")
                await ledger.cancel("run_2", by="u")
            await kill_at("settle")
            await other.call(send.tool, "c", key="c")  # the other run goes on
        violations = [
            *await judge(ledger, "run_2", {"send": send}),
            *await judge(ledger, "run_other", {"send": send}),
        ]
        states = {
            run_id: (await ledger.backend.get_run(run_id)).state
            for run_id in ("run_1", "run_2", "run_other")
        }
    assert killed and killed[0] >= 1  # the fault happened
    assert violations == []
    assert states == {
        "run_1": RunState.COMPLETED,
        "run_2": RunState.CANCELLED,
        "run_other": RunState.COMPLETED,  # nobody cancelled it, and nothing did
    }
    assert send.effects == ["run_2/a", "run_other/c"]


def _cluster() -> list[str] | None:
    """``pg_ctlcluster VERSION main`` for the local server, if this machine runs it and the
    server is this suite's own (CI) or a restart was asked for (``STOPLINE_TEST_PG_RESTART=1``):
    on a server shared with others' tests, ending this schema's connections stands in."""
    if os.environ.get("CI") != "true" and os.environ.get("STOPLINE_TEST_PG_RESTART") != "1":
        return None
    versions = Path("/etc/postgresql")
    if not versions.is_dir() or not any(versions.iterdir()):
        return None
    return ["pg_ctlcluster", "--skip-systemctl-redirect", sorted(versions.iterdir())[-1].name]


async def test_a_server_restart_costs_typed_errors_only(pg_url: str) -> None:
    """One restart of the shared server; every other test tolerates it (they retry)."""
    cluster = _cluster()
    send = FakeProvider("send")
    errors: list[stopline.StoplineError] = []
    async with stopline.open(f"{pg_url}&retry_for=30") as ledger:
        async with ledger.run("job", owner="u", run_id="run_1") as run:
            await run.call(send.tool, "before", key="before")
            if cluster is not None:
                await anyio.run_process([*cluster, "main", "restart"])
            else:  # no local cluster to restart: end every connection instead
                schema = pg_url.rsplit("schema=", 1)[1]
                await anyio.to_thread.run_sync(terminate, schema)
            try:
                await run.call(send.tool, "after", key="after")
            except stopline.StoplineError as exc:  # only typed errors, if any
                errors.append(exc)
                await run.call(send.tool, "after", key="after")
        violations = await judge(ledger, "run_1", {"send": send})
        state = (await ledger.backend.get_run("run_1")).state
    assert violations == []
    assert state is RunState.COMPLETED
    assert send.effects == ["run_1/before", "run_1/after"]
    # what the restart may cost: a storage error naming the ledger, nothing else
    assert all(isinstance(e, stopline.LedgerError) for e in errors), errors
    if cluster is not None:  # the server is up again for everyone else
        done = await anyio.run_process([*cluster, "main", "status"], check=False)
        assert done.returncode == 0
