"""The soak on PostgreSQL: a schema of its own, and faults of a shared server.

The workers' connections carry an ``application_name`` of the soak's own, so
the faults find them in ``pg_stat_activity``: one of them terminated (a
connection lost mid-transaction, a commit in doubt, a LISTEN dropped), all of
them terminated at once (what a server restart does to a process), or a few
live runs locked by another session for 50-300 ms (a gate, an outcome or a
cancel waiting on a row, and the deadlocks PostgreSQL breaks).
"""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

__all__ = ["inject", "ledger", "size_mib"]

_APP = "stopline-soak"


@contextlib.contextmanager
def ledger(server: str) -> Iterator[tuple[str, str]]:
    """(the soak's ledger URL, its schema) on ``server``; the schema dropped after."""
    import psycopg

    schema = f"soak_{uuid.uuid4().hex[:12]}"
    joiner = "&" if "?" in server else "?"
    url = f"{server}{joiner}schema={schema}&application_name={_APP}_{schema}"
    try:
        yield url, schema
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def inject(server: str, schema: str, until: float) -> dict[str, int]:
    """Random faults until ``until``, with quiet stretches of 0.2-1.0 s between."""
    import psycopg

    rng = random.Random()
    counts = {"one_connection_lost": 0, "all_connections_lost": 0, "runs_locked": 0}
    mine = f"{_APP}_{schema}"
    with psycopg.connect(server, autocommit=True) as conn:
        while time.time() < until:
            time.sleep(rng.uniform(0.2, 1.0))
            pick = rng.random()
            pids = [
                pid
                for (pid,) in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (mine,)
                )
            ]
            if pick < 0.4 and pids:
                counts["one_connection_lost"] += 1
                conn.execute("SELECT pg_terminate_backend(%s)", (rng.choice(pids),))
            elif pick < 0.6 and pids:
                counts["all_connections_lost"] += 1
                conn.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) pid", (pids,))
            else:
                counts["runs_locked"] += _lock_some_runs(conn, schema, rng.uniform(0.05, 0.3))
    return counts


def _lock_some_runs(conn: Any, schema: str, seconds: float) -> int:
    """Lock a few live runs for ``seconds``; 0 if there were none or this session lost
    a deadlock (PostgreSQL chose it to break one: the workers went on)."""
    import psycopg

    try:
        with conn.transaction():
            locked = conn.execute(
                f'SELECT id FROM "{schema}".runs WHERE state = %s'
                " ORDER BY random() LIMIT 5 FOR UPDATE",
                ("running",),
            ).fetchall()
            time.sleep(seconds)
    except psycopg.errors.DeadlockDetected:
        return 0
    except psycopg.errors.UndefinedTable:
        return 0  # the schema is not made yet
    return 1 if locked else 0


def size_mib(server: str, schema: str) -> float:
    """The schema's tables, their indexes and TOAST, in MiB."""
    import psycopg

    with psycopg.connect(server, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relkind = 'r'",
            (schema,),
        ).fetchone()
    return float(row[0] if row else 0) / 2**20
