"""`degraded` where an operator looks: `stopline stats` and the console."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
from starlette.testclient import TestClient

import stopline
from stopline.console import ConsoleConfig, create_app
from stopline.domain.model import OperationSpec
from stopline.errors import LedgerFull
from tests.surfaces.test_cli import as_json, stopline_cli


async def lapsed_worker(url: str) -> None:
    """A worker holding an operation in flight whose lease renewals stopped landing."""
    async with stopline.open(url) as ledger, ledger.run("job", owner="u", run_id="run_1"):
        spec = OperationSpec(
            id="run_1/op",
            run_id="run_1",
            tool="send",
            args_digest="d",
            description="send",
            cancellable=stopline.Cancellable.NEVER,
            can_verify=False,
            can_compensate=False,
            worker="w_lapsed",
        )
        await ledger.backend.gate(spec)
        await ledger.backend.heartbeat(
            "w_lapsed", host="elsewhere", pid=4242, lease_until=time.time() - 60
        )


def test_stats_shows_a_worker_whose_lease_lapsed_as_degraded(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(lapsed_worker, url)
    degraded = as_json(stopline_cli("stats", "--json", ledger=url))["degraded"]
    assert [(w["worker"], w["in_flight"]) for w in degraded] == [("w_lapsed", 1)]
    assert degraded[0]["lapsed_s"] >= 60
    text = stopline_cli("stats", ledger=url).stdout
    assert "degraded: worker w_lapsed (pid 4242) lease lapsed" in text


def test_the_console_shows_degraded_background_work(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"

    async def serve() -> str:
        async with stopline.open(url) as ledger:
            ledger.health.failed("advance", LedgerFull(url, "disk is full"), retrying=True)
            ledger.health.failing("advance", True)
            app = create_app(ConsoleConfig(url=url, token="tok"), ledger=ledger)
            with TestClient(app, base_url="http://127.0.0.1") as client:
                client.get("/?token=tok&name=ada")
                page = await anyio.to_thread.run_sync(client.get, "/")
            return page.text

    text = anyio.run(serve)
    # the stored error, isolated as every stored value is (ADR 0070)
    assert "<b>degraded</b>" in text and "advance: <bdi>LedgerFull" in text
