"""``Writer.submit(..., first=)``: a hook run on the caller's loop as soon as the job
has committed, before its caller resumes (ADR 0043: a cancel's cut rides it)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path

import pytest

from stopline.errors import LedgerError
from stopline.ledger import open_backend
from stopline.ledger.sqlite import SQLiteBackend

pytestmark = pytest.mark.uvloop_too  # a loop we did not write (conftest)


async def _backend(path: Path) -> SQLiteBackend:
    backend = await open_backend(f"sqlite:///{path}")
    assert isinstance(backend, SQLiteBackend)
    return backend


def _write(conn: sqlite3.Connection) -> int:
    conn.execute("CREATE TABLE IF NOT EXISTS t (x)")
    return conn.execute("INSERT INTO t VALUES (1)").rowcount


async def test_first_gets_the_result_on_the_loop_before_the_caller(tmp_path: Path) -> None:
    backend = await _backend(tmp_path / "l.db")
    seen: list[object] = []

    def first(result: int) -> None:
        seen.append(("first", result, asyncio.current_task()))

    try:
        got = await backend._writer.submit(_write, first=first)
        seen.append(("caller", got))
    finally:
        await backend.close()
    assert seen == [("first", 1, None), ("caller", 1)]


async def test_a_job_that_fails_calls_no_first_and_its_caller_learns_why(tmp_path: Path) -> None:
    backend = await _backend(tmp_path / "l.db")
    seen: list[object] = []

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO no_such_table VALUES (1)")

    try:
        with pytest.raises(LedgerError, match="no such table"):
            await backend._writer.submit(broken, first=seen.append)
    finally:
        await backend.close()
    assert seen == []


async def test_a_first_that_raises_is_logged_and_the_caller_still_gets_its_result(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await _backend(tmp_path / "l.db")

    def first(result: int) -> None:
        raise LookupError("hook broke")

    try:
        with caplog.at_level(logging.ERROR, logger="stopline.ledger.sqlite"):
            assert await backend._writer.submit(_write, first=first) == 1
    finally:
        await backend.close()
    assert any("committed hook failed" in r.getMessage() for r in caplog.records)
