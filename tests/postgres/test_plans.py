"""The hot statements reach their rows through an index on PostgreSQL too.

A gate or an outcome costs what the call touches, not what the ledger holds.
On tables it has not analyzed yet (a new ledger, or one that grew since),
PostgreSQL tied the state index with the primary key and could walk every
live run for each gate, and took a group's outcomes by scanning the whole
operations table. Each form, one row and many, is explained here on a ledger
of thousands of live runs and operations that the planner has no statistics
for.
"""

from __future__ import annotations

import re
import time
from typing import Any

import psycopg

from stopline.domain.model import Evidence
from stopline.domain.vocab import OpEvent, RunState
from stopline.ledger import rows
from stopline.ledger.backend import OutcomeUpdate
from stopline.ledger.engine import fence, reads
from stopline.ledger.engine.gate import GATE_PASSED_WHERE, gate_params, intent_sql
from stopline.ledger.engine.reads import ops_query, runs_query
from stopline.ledger.engine.record import record_params
from stopline.ledger.engine.runs import move_query
from stopline.ledger.postgres import PostgresBackend
from stopline.ledger.postgres_dialect import PostgresDialect, gate_forms, many_rows, outcome_forms
from stopline.ledger.postgres_listen import CATCH_UP, CATCH_UP_SLACK
from stopline.ledger.postgres_txn import pg_sql
from tests.ledger.contract import op_spec

_TABLES = ("runs", "operations", "events", "approvals", "run_owners", "workers")
RUNS, OPS = 3_000, 20_000


def _explain(conn: psycopg.Connection[Any], sql: str, params: Any) -> list[str]:
    return [str(line) for (line,) in conn.execute("EXPLAIN " + pg_sql(sql), params)]


async def _ledger(pg_url: str, runs: int, ops: int) -> psycopg.Connection[Any]:
    """A connection to a ledger of ``runs`` live runs and ``ops`` operations, never
    analyzed."""
    opened = await PostgresBackend.open(pg_url)  # the schema, as the runtime makes it
    await opened.close()
    base, _, schema = pg_url.partition("?schema=")
    conn = psycopg.connect(base, autocommit=True, options=f"-c search_path={schema}")
    grow(conn, runs, ops)
    return conn


def grow(conn: psycopg.Connection[Any], runs: int, ops: int, status: str = "requested") -> None:
    """``runs`` live runs (``run_0``...) and ``ops`` operations in ``status`` among them."""
    now = time.time()
    conn.execute(
        "INSERT INTO runs (id, name, owner, tenant, state, fence, grants, policy,"
        " created_at, updated_at) SELECT 'run_' || i, 'j', 'u', 't', 'running', 0, 15,"
        " 'verify', %s, %s FROM generate_series(0, %s) i",
        (now, now, runs - 1),
    )
    conn.execute(
        "INSERT INTO operations (id, run_id, tool, description, args_digest, status,"
        " cancellable, can_verify, can_compensate, evidence, created_at, updated_at)"
        " SELECT 'op_' || i, 'run_' || (i %% %s), 't', 't', 'd', %s, 'never',"
        " 1, 0, '[]', %s, %s FROM generate_series(0, %s) i",
        (runs, status, now, now, ops - 1),
    )


def own_by_hundreds(conn: psycopg.Connection[Any], runs: int) -> None:
    """Each run from ``run_300`` owned exclusively by ``run_<its number / 100>``: the
    runs below 300 own a hundred each, and ``runs - 300`` ownerships are live."""
    conn.execute(
        "INSERT INTO run_owners (run_id, owner_run, exclusive, created_at)"
        " SELECT 'run_' || i, 'run_' || (i / 100), 1, %s FROM generate_series(300, %s) i",
        (time.time(), runs - 1),
    )


def _walks(plans: dict[str, list[str]]) -> list[tuple[str, str]]:
    """Each step of the plans that scans a ledger table or takes the state index."""
    return [
        (form, step)
        for form, plan in plans.items()
        for step in plan
        if any(re.search(rf"Seq Scan on {t}\b", step) for t in _TABLES) or "runs_state" in step
    ]


async def test_the_gate_and_the_outcome_forms_use_their_indexes(pg_url: str) -> None:
    with await _ledger(pg_url, RUNS, OPS) as conn:
        now = time.time()
        dialect = PostgresDialect(None)
        gate = gate_forms(*intent_sql(dialect, False, False))
        gates = [
            gate_params(op_spec(f"new_{i}", f"run_{i}", digest="d"), now, None) for i in range(20)
        ]
        update = OutcomeUpdate(OpEvent.COMMITTED, [Evidence.local("response")])
        outcome = outcome_forms(OpEvent.COMMITTED)
        outcomes = [record_params(f"op_{i * 7}", update, now) for i in range(20)]
        plans = {
            "one gate": _explain(conn, gate.one, gates[0]),
            "many gates": _explain(conn, gate.many, many_rows(gates)),
            "one outcome": _explain(conn, outcome.one, outcomes[0]),
            "many outcomes": _explain(conn, outcome.many, many_rows(outcomes)),
        }
    assert _walks(plans) == []
    assert all(any("operations_pkey" in step for step in plans[f]) for f in plans if "outcome" in f)
    assert all(any("runs_pkey" in step for step in plans[f]) for f in plans if "gate" in f)


async def test_a_trees_settle_forms_use_their_indexes_on_a_grown_ledger(pg_url: str) -> None:
    """The reads and the move of a cancelled tree's runs settling together (ADR 0037),
    20 runs of a ledger never analyzed. On a small one (3,000 runs) PostgreSQL scans
    ``runs`` for 20 ids, and rightly: the table is a few pages. Without statistics it
    guesses 0.5% of the rows per id, so until its first analyze a ledger of ~60,000
    operations is scanned for a settle step's operations; at the size here, as after
    an analyze at any size, every form takes its index."""
    with await _ledger(pg_url, 30_000, 200_000) as conn:
        dialect = PostgresDialect(None)
        runs = [f"run_{i * 11}" for i in range(20)]
        ops = [f"op_{i * 13}" for i in range(20)]
        moving = RunState.CANCELLING, RunState.SETTLING
        plans = {
            "many runs, locked": _explain(conn, *runs_query(dialect, runs, lock=True)),
            "many runs' operations": _explain(conn, *ops_query(dialect, "run_id", runs)),
            "many operations": _explain(conn, *ops_query(dialect, "id", ops)),
            "many runs moved": _explain(conn, *move_query(dialect, runs, *moving, time.time())),
        }
    assert _walks(plans) == []
    for form, index in [
        ("many runs, locked", "runs_pkey"),
        ("many runs' operations", "ops_run"),
        ("many operations", "operations_pkey"),
        ("many runs moved", "runs_pkey"),
    ]:
        assert any(index in step for step in plans[form]), (form, plans[form])


async def test_a_trees_fence_finds_its_runs_links_and_approvals_by_id(pg_url: str) -> None:
    """A tree's fence (20 runs) on a grown ledger never analyzed: the next level's links
    through ``run_owners_owner``, the approvals through ``approvals_run`` (a run's state
    read only for a live one), the cancel events and the fence through the runs' key. A
    walk of ``approvals``, ``runs`` or ``runs_state`` would cost what the ledger holds,
    not what the tree does. (With 10,000 approvals PostgreSQL scans them all, and rightly:
    unanalyzed, the table is a few pages; at 100,000, as after an analyze, it takes the
    index.)"""
    with await _ledger(pg_url, 30_000, 20_000) as conn:
        now = time.time()
        own_by_hundreds(conn, 30_000)
        conn.execute(
            "INSERT INTO approvals (id, run_id, scope, approver, status, requested_by,"
            " created_at) SELECT 'ap_' || i, 'run_' || (i %% 30000), 's', 'a',"
            " CASE WHEN i %% 2 = 0 THEN 'pending' ELSE 'denied' END, 'u', %s"
            " FROM generate_series(0, 99999) i",
            (now,),
        )
        dialect = PostgresDialect(None)
        tree = [f"run_{i}" for i in range(300, 320)]
        (fused,) = fence._fence(dialect, tree, "run_3", "bench", "", now)
        links = fence._links(dialect, tree, exclusive_only=False)
        plans = {
            "the next level's links": _explain(conn, *links),
            "the fence": _explain(conn, *fused),
        }
    assert _walks(plans) == [], plans
    assert any("run_owners_owner" in step for step in plans["the next level's links"]), plans
    fenced = plans["the fence"]
    assert any("approvals_run" in step for step in fenced), fenced
    assert sum("runs_pkey" in step for step in fenced) >= 3, fenced  # the EXISTS, events, fence


async def test_a_receipts_read_of_a_runs_tree_takes_the_operations_index(pg_url: str) -> None:
    """A run's receipt reads its operations and those of the runs it owns exclusively (a
    recursive read of its tree). On a ledger never analyzed (a new one, or a server with
    autovacuum off, as this machine's) PostgreSQL took the tree's share of the table for
    ~5% and scanned every operation: 46 ms a receipt at 90,000 operations, growing with
    the ledger (found by the PostgreSQL soak)."""
    with await _ledger(pg_url, RUNS, OPS) as conn:
        now = time.time()
        conn.execute(
            "INSERT INTO run_owners (run_id, owner_run, exclusive, created_at)"
            " SELECT 'run_' || i, 'run_7', 1, %s FROM generate_series(100, 104) i",
            (now,),
        )
        tree = reads.operations_query(PostgresDialect(None), "run_7", True)
        plan = _explain(conn, *tree)
        found = conn.execute(pg_sql(tree[0]), tree[1]).fetchall()
    assert _walks({"a tree's operations": plan}) == [], plan
    assert any("ops_run" in step for step in plan), plan
    assert {row[1] for row in found} == {"run_7", *(f"run_{i}" for i in range(100, 105))}


async def test_a_gates_doubt_is_settled_through_its_runs_log(pg_url: str) -> None:
    """After a lost reply, whether a gate attempt landed is read from its operation's
    ``gate_passed`` events. The log has no index by operation: read by ``op_id`` alone it
    was read whole (found by the PostgreSQL soak, whose connections are terminated at
    random). Through the operation's run it takes ``events_run``."""
    with await _ledger(pg_url, RUNS, OPS) as conn:
        now = time.time()
        conn.execute(
            "INSERT INTO events (at, run_id, op_id, kind, data) SELECT %s, 'run_' || (i %% %s),"
            " 'op_' || i, 'gate_passed', '{}' FROM generate_series(0, %s) i",
            (now, RUNS, OPS - 1),
        )
        params = ("op_77", "op_77", "gate_passed")
        plan = _explain(conn, f"SELECT data FROM events WHERE {GATE_PASSED_WHERE}", params)
    assert _walks({"a gate's doubt": plan}) == [], plan
    assert any("events_run" in step for step in plan), plan


async def test_a_listeners_catch_up_reads_the_runs_cancelled_since(pg_url: str) -> None:
    """A listener whose connection dropped catches up with the runs cancelled since. On a
    ledger never analyzed, with 200,000 runs cancelled a day ago and 4 just now, it read
    the state index's entry of every run ever fenced (33 ms, growing with the history).
    Through the index of cancel times (schema V6) it reads the 4, and keeps those still
    fenced: one of them was resumed since."""
    with await _ledger(pg_url, 1_000, 0) as conn:
        now = time.time()
        conn.execute(
            "INSERT INTO runs (id, name, owner, tenant, state, fence, grants, policy,"
            " created_at, updated_at, cancelled_at) SELECT 'old_' || i, 'j', 'u', 't',"
            " 'cancelled', 1, 0, 'verify', %s, %s, %s FROM generate_series(0, 199999) i",
            (now, now, now - 86_400),
        )
        conn.execute(
            "UPDATE runs SET cancelled_at = %s, state = CASE id WHEN 'run_3' THEN 'running'"
            " WHEN 'run_2' THEN 'needs_review' ELSE 'cancelling' END"
            " WHERE id IN ('run_0', 'run_1', 'run_2', 'run_3')",
            (now,),
        )
        since = (now - CATCH_UP_SLACK,)
        plan = [str(line) for (line,) in conn.execute("EXPLAIN " + CATCH_UP, since)]
        found = conn.execute(CATCH_UP, since).fetchall()
    assert _walks({"the catch-up": plan}) == [], plan
    assert any("runs_cancelled" in step for step in plan), plan
    assert sorted(found) == [
        ("run_0", "cancelling"),
        ("run_1", "cancelling"),
        ("run_2", "needs_review"),
        ("run_3", "running"),
    ]


async def test_a_page_of_runs_reads_the_newest_and_their_trees_through_indexes(
    pg_url: str,
) -> None:
    """The console's page (every 2 s) and ``stopline runs``: the newest 200 runs, then
    their receipts at once. On a ledger never analyzed, with 30,000 exclusive
    ownerships live, the listing sorted every run (no index of start times before
    schema V7), and the trees of 200 runs, read as a join, hashed every live
    ownership the ledger ever made; each run's owned runs are looked up through
    ``run_owners_owner`` instead, as a subplan."""
    with await _ledger(pg_url, 30_000, 20_000) as conn:
        own_by_hundreds(conn, 30_000)
        dialect = PostgresDialect(None)
        page = [f"run_{i}" for i in range(200)]
        roots, params = dialect.each_of(page)
        newest = rows.list_runs_query(None, None, 200, "?")
        plans = {
            "the newest runs": _explain(conn, *newest),
            "their trees": _explain(conn, *reads._trees(dialect, roots, params)),
            "their trees' operations": _explain(conn, *reads._tree_ops(dialect, roots, params)),
        }
        trees = conn.execute(pg_sql(reads._trees(dialect, roots, params)[0]), params).fetchall()
    assert _walks(plans) == [], plans
    assert any("runs_created" in step for step in plans["the newest runs"]), plans
    for form in ("their trees", "their trees' operations"):
        assert not any("Hash" in step for step in plans[form]), plans[form]
        assert any("run_owners_owner" in step for step in plans[form]), plans[form]
    assert any("ops_run" in step for step in plans["their trees' operations"])
    assert len(trees) == 200 + 200 * 100 - 300  # each run, and runs 300-19,999 below theirs
