"""A row stopline cannot read is ``LedgerCorrupt`` naming it, on both engines.

A state no release writes, event data that is not a JSON object, evidence that is
not JSON: rows another program wrote into a ledger (by hand, a bad restore) came
out of a read as a bare ``ValueError``, ``JSONDecodeError`` or ``AttributeError``
from deep inside it; the CLI printed a traceback and the console answered 500.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

import stopline
from stopline import LedgerCorrupt
from tests.postgres.server import server_url

pytestmark = pytest.mark.timeout(30)


def tamper(url: str, sql: str, *params: Any) -> None:
    """Change the ledger's rows behind stopline's back, as another program would."""
    if url.startswith("sqlite:///"):
        import sqlite3

        with sqlite3.connect(url.removeprefix("sqlite:///")) as db:
            db.execute(sql, params)
        db.close()
        return
    import psycopg

    schema = parse_qs(urlsplit(url).query)["schema"][0]
    with psycopg.connect(server_url(), autocommit=True) as pg:
        pg.execute(f'SET search_path TO "{schema}"')
        pg.execute(sql.replace("?", "%s"), params)


async def one_run(ledger: stopline.Ledger) -> str:
    async def send(ctx: stopline.CallContext) -> str:
        return "sent"

    async with ledger.run("job", owner="user:1", run_id="run-t") as run:
        await run.call(stopline.Tool(send), key="k")
    return run.id


Read = Callable[[stopline.Ledger], Any]
CASES: dict[str, tuple[str, Read, str]] = {
    "op-status": (
        "UPDATE operations SET status = 'exploded'",
        lambda ledger: ledger.backend.get_operation("run-t/k"),
        "row of operation 'run-t/k'",
    ),
    "run-state": (
        "UPDATE runs SET state = 'exploded'",
        lambda ledger: ledger.backend.get_run("run-t"),
        "row of run 'run-t'",
    ),
    "event-not-json": (
        "UPDATE events SET data = '{not json'",
        lambda ledger: ledger.backend.events("run-t"),
        "row of event",
    ),
    "event-not-object": (
        "UPDATE events SET data = '[1, 2]'",
        lambda ledger: ledger.backend.events("run-t"),
        "row of event",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_row_no_release_writes_is_ledger_corrupt_naming_it(
    ledger_url: str, case: str
) -> None:
    sql, read, named = CASES[case]
    async with stopline.open(ledger_url) as ledger:
        await one_run(ledger)
    tamper(ledger_url, sql)
    async with stopline.open(ledger_url) as ledger:
        with pytest.raises(LedgerCorrupt, match="cannot be read") as caught:
            await read(ledger)
    assert named in str(caught.value)


async def test_evidence_that_is_not_json_is_ledger_corrupt_when_read(ledger_url: str) -> None:
    async with stopline.open(ledger_url) as ledger:
        await one_run(ledger)
    tamper(ledger_url, "UPDATE operations SET evidence = '{bad'")
    async with stopline.open(ledger_url) as ledger:
        op = await ledger.backend.get_operation("run-t/k")  # evidence is read on use
        with pytest.raises(LedgerCorrupt, match="row of evidence"):
            list(op.evidence)
        with pytest.raises(LedgerCorrupt):
            (await ledger.receipt("run-t")).text()
