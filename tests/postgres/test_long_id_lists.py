"""A read naming many runs passes their ids as one array on PostgreSQL (ADR 0044).

PostgreSQL's protocol carries at most 65,535 parameters a statement. The listener's
read of which notified runs are still fenced took a parameter per run: a cancel of a
tree past that, notified to another process, could not be read there. On the real
server, with 70,000 ids.
"""

from __future__ import annotations

import pytest

from stopline.ledger.backend import RunSpec
from stopline.ledger.postgres import PostgresBackend

pytestmark = pytest.mark.timeout(60)

IDS = 70_000  # past the protocol's 65,535 parameters


async def test_which_of_70000_notified_runs_are_fenced_is_read_in_one_statement(
    pg_url: str,
) -> None:
    backend = await PostgresBackend.open(pg_url)
    try:
        for run_id in ("fenced", "running"):
            await backend.create_run(RunSpec(run_id, run_id, "u", "t"))
        await backend.cancel("fenced", by="u")
        named = [f"gone-{n}" for n in range(IDS - 2)] + ["running", "fenced"]
        assert await backend.fenced_among(named) == ["fenced"]
    finally:
        await backend.close()
