"""A statement naming many runs passes their ids as one JSON array (ADR 0044).

SQLite caps a statement's parameters: 32,766 in its default build since 3.32, 999
before it, 250,000 in Debian's. A tree's fence names every run of the tree, and with a
parameter per id a tree past the cap could not be cancelled at all: the cancel failed
with "too many SQL variables" and nothing was fenced. Here the writer's connection is
held to 999, and a tree of 1,200 children is cancelled, paused, and read.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stopline.domain.vocab import RunState
from stopline.errors import LedgerError
from stopline.ledger.backend import RunSpec
from stopline.ledger.engine.dialect import LONG_LIST, Dialect
from stopline.ledger.sqlite import SQLiteBackend

CAP = 999  # SQLite's own default before 3.32
CHILDREN = 1_200


def _capped(conn: sqlite3.Connection) -> None:
    conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, CAP)


@pytest.fixture
async def tree(tmp_path: Path) -> AsyncIterator[SQLiteBackend]:
    """A ledger holding a root run with ``CHILDREN`` children, its writer capped."""
    backend = await SQLiteBackend.open(tmp_path / "l.db", cancel_poll=0)
    try:
        await backend.create_run(RunSpec("root", "root", "u", "t"))
        for n in range(CHILDREN):
            await backend.create_run(RunSpec(f"root-{n}", f"c{n}", "u", "t", parent_id="root"))
        await backend.transact(_capped)
        yield backend
    finally:
        await backend.close()


async def test_the_cap_holds_on_the_writers_connection(tree: SQLiteBackend) -> None:
    """The premise: a statement with a parameter per run of the tree fails there."""
    marks = ", ".join("?" * (CHILDREN + 1))
    with pytest.raises(LedgerError, match="too many SQL variables"):
        await tree.transact(
            lambda conn: conn.execute(
                f"SELECT id FROM runs WHERE id IN ({marks})", [""] * (CHILDREN + 1)
            )
        )


async def test_a_tree_past_sqlites_parameter_cap_is_cancelled(tree: SQLiteBackend) -> None:
    result = await tree.cancel("root", by="u")
    assert len(result.fenced) == CHILDREN + 1
    runs = await tree.get_runs([f"root-{n}" for n in range(CHILDREN)])
    assert {run.state for run in runs.values()} == {RunState.CANCELLING}
    assert len(runs) == CHILDREN
    assert await tree.operations("root", descendants=True) == []


async def test_a_tree_past_sqlites_parameter_cap_is_paused(tree: SQLiteBackend) -> None:
    paused = await tree.pause("root", by="u")
    assert len(paused) == CHILDREN + 1
    assert (await tree.get_run("root-0")).state is RunState.PAUSED


def test_a_short_list_keeps_a_parameter_per_value() -> None:
    """The plans of the statements naming a few runs (most of them) stay as measured."""
    short, params = Dialect().in_list("id", ["a"] * LONG_LIST)
    assert short.count("?") == LONG_LIST and params == ["a"] * LONG_LIST
    long, params = Dialect().in_list("id", ["a", "b"] * LONG_LIST)
    assert long == "id IN (SELECT value FROM json_each(?))" and params == [
        '["a", "b"' + ', "a", "b"' * (LONG_LIST - 1) + "]"
    ]
