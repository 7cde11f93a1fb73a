"""A run's move is decided in SQL from the run table itself (``guards.run_moves``): for every
state and every event, the statement moves exactly as ``apply`` does, on both
engines' spelling of the column."""

from __future__ import annotations

import sqlite3

import pytest

from stopline.domain.transitions import RUN_TABLE, apply
from stopline.domain.vocab import RunEvent, RunState
from stopline.errors import IllegalTransition
from stopline.ledger.engine.dialect import Dialect
from stopline.ledger.engine.guards import run_moves
from stopline.ledger.postgres_dialect import PostgresDialect
from tests.postgres.server import require_server


def _expected(kind: RunEvent) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for state in RunState:
        try:
            out[state.value] = apply(RUN_TABLE, state, kind).value
        except IllegalTransition:
            out[state.value] = None
    return out


def test_every_state_moves_by_every_event_as_the_table_says_on_sqlite() -> None:
    state = Dialect().unindexed("state")
    with sqlite3.connect(":memory:") as conn:
        for kind in RunEvent:
            moves = run_moves(state, kind)
            if moves is None:
                assert not any(event is kind for _, event in RUN_TABLE)
                continue
            target_of, movable = moves
            conn.execute("DROP TABLE IF EXISTS runs")
            conn.execute("CREATE TABLE runs (id TEXT PRIMARY KEY, state TEXT, moved TEXT)")
            every = [(s.value, s.value) for s in RunState]
            conn.executemany("INSERT INTO runs VALUES (?, ?, NULL)", every)
            conn.execute(f"UPDATE runs SET moved = {target_of} WHERE {movable}")
            got = dict(conn.execute("SELECT id, moved FROM runs").fetchall())
            assert got == _expected(kind), kind


@pytest.mark.timeout(60)
def test_every_state_moves_by_every_event_as_the_table_says_on_postgres() -> None:
    import psycopg

    state = PostgresDialect(None).unindexed("state")
    with psycopg.connect(require_server(), autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE moves (id TEXT PRIMARY KEY, state TEXT, moved TEXT)")
        for kind in RunEvent:
            moves = run_moves(state, kind)
            if moves is None:
                continue
            target_of, movable = moves
            conn.execute("DELETE FROM moves")
            with conn.cursor() as cur:
                every = [(s.value, s.value) for s in RunState]
                cur.executemany("INSERT INTO moves VALUES (%s, %s, NULL)", every)
            conn.execute(f"UPDATE moves SET moved = {target_of} WHERE {movable}")
            got: dict[str, str | None] = dict(
                conn.execute("SELECT id, moved FROM moves").fetchall()
            )
            assert got == _expected(kind), kind


@pytest.mark.timeout(120)
async def test_the_one_statement_move_moves_every_state_as_the_table_says() -> None:
    """PostgreSQL's move is one statement (``PostgresDialect.move_sql``): for every state
    and every event, on a real ledger, it moves and logs exactly what ``apply`` says, and
    writes nothing for a move the table refuses."""
    from stopline.ledger.postgres import PostgresBackend
    from tests.ledger.contract import run_spec
    from tests.postgres.server import fresh_schema
    from tests.postgres.test_backend import sql

    for url in fresh_schema():
        backend = await PostgresBackend.open(url)
        try:
            for kind in RunEvent:
                if kind is RunEvent.CANCEL:  # the subtree fence, not a move
                    continue
                expected = _expected(kind)
                for state in RunState:
                    run_id = f"{kind.value}_{state.value}"
                    await backend.create_run(run_spec(run_id))
                    sql(url, "UPDATE runs SET state = %s WHERE id = %s", state.value, run_id)
                    try:
                        run, moved = await backend.run_event(run_id, kind, by="u")
                    except IllegalTransition:
                        assert expected[state.value] is None, (kind, state)
                        after = (await backend.get_run(run_id)).state
                        assert after is state, (kind, state)
                        logged = [e.kind for e in await backend.events(run_id)]
                        assert logged == ["run_created"], (kind, state)
                        continue
                    assert moved and run.state.value == expected[state.value], (kind, state)
                    assert (await backend.get_run(run_id)).state is run.state
                    events = [e for e in await backend.events(run_id) if e.kind != "run_created"]
                    assert [(e.kind, e.from_state, e.to_state) for e in events] == [
                        (kind.value, state.value, run.state.value)
                    ], (kind, state)
        finally:
            await backend.close()
