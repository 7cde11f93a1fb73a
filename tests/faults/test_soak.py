"""A short soak: worker processes, a canceller, random faults; nothing violated or torn down."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from stopline.bench.soak import soak
from tests.postgres.server import require_server


@pytest.mark.timeout(180)
def test_a_short_soak_violates_nothing_and_tears_nothing_down(tmp_path: Path) -> None:
    figures = soak(tmp_path, seconds=4, workers=2)
    assert figures["operations"] > 0
    assert sum(figures["faults"].values()) > 0
    assert figures["violations"] == 0, figures["first_violations"]
    assert figures["teardowns"] == 0
    assert figures["hung"] == 0
    assert figures["ledger_mib"] > 0  # the ledger's size at the end, its log included


@pytest.mark.timeout(180)
def test_a_short_postgres_soak_violates_nothing_and_leaves_no_schema(tmp_path: Path) -> None:
    """The workers' connections terminated (one, or all at once) and live runs locked by
    another session, on the real server; the soak's schema is dropped after."""
    server = require_server()
    with psycopg.connect(server, autocommit=True) as conn:
        before = _soak_schemas(conn)
    figures = soak(tmp_path, seconds=6, workers=2, postgres=server)
    assert figures["operations"] > 0
    assert sum(figures["faults"].values()) > 0
    assert figures["violations"] == 0, figures["first_violations"]
    assert figures["teardowns"] == 0
    assert figures["hung"] == 0
    assert figures["ledger_mib"] > 0
    with psycopg.connect(server, autocommit=True) as conn:
        assert _soak_schemas(conn) == before


def _soak_schemas(conn: psycopg.Connection[tuple[str]]) -> set[str]:
    rows = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'soak\\_%'")
    return {name for (name,) in rows}


@pytest.mark.timeout(240)
def test_a_short_crash_soak_recovers_every_killed_workers_runs(tmp_path: Path) -> None:
    """Workers killed (SIGKILL) at random and replaced, beside the storage faults; a
    judge recovers what they left in flight and checks every run they started against
    the providers' file."""
    figures = soak(tmp_path, seconds=8, workers=2, crashes=True)
    assert figures["faults"]["workers_killed"] >= 1
    assert figures["judged"] > 0  # the killed workers' runs, each checked
    assert figures["violations"] == 0, figures["first_violations"]
    assert figures["teardowns"] == 0
    assert figures["hung"] == 0
