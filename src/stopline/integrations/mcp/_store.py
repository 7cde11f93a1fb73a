"""The server's durable record of operations by idempotency key (SQLite, stdlib).

Synchronous on purpose: each method is one transaction, called through
``anyio.to_thread`` from async tools (one hop per transaction) and directly
from sync tools, which already run in a worker thread. A connection per
transaction keeps it safe across threads and across server processes that
share the file (a restarted server reads what the previous one committed).

Each claim names the process that made it (host, pid, and the pid's start time
where ``/proc`` tells it). Recovery at start resolves only the claims of
processes that have ended: another live server on the same file (a stdio
server per client, HTTP workers) keeps its work in flight.

Besides the claims, the file holds what the record of a tracked tool's call cannot
(ADR 0067): each keyed call of such a tool on its way to the tool's body
(``stopline_arrivals``, written before the body may run, gone once the call records or
ends), and each that ended without recording anything (``stopline_unrecorded``, with how
it ended). So every server on the file, and the one started after a crash, can tell a
key no call brought from one a call brought and left no record of.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic_core

from stopline.domain.limits import MAX_RESULT_CHARS

__all__ = ["EffectRecord", "EffectState", "EffectStore", "Ending", "Evidence", "Unrecorded"]


class EffectState(enum.StrEnum):
    RECEIVED = "received"  # the tool began; nothing done yet
    ACCEPTED = "accepted"  # acknowledged to the client; nothing committed yet
    COMMITTING = "committing"  # inside the shielded commit: the effect may be happening
    COMMITTED = "committed"  # done; the result is recorded
    NOT_COMMITTED = "not_committed"  # stopped or refused before any effect
    UNKNOWN = "unknown"  # the commit failed part-way, or its process died inside it

    @property
    def terminal(self) -> bool:
        return self in (EffectState.COMMITTED, EffectState.NOT_COMMITTED, EffectState.UNKNOWN)


class Ending(enum.StrEnum):
    """How a call of a tool declared tracked ended when it recorded nothing (ADR 0063,
    0067). Whatever it did is not in the record: its key's verdict is ``unknown``."""

    ANSWERED = "answered"  # it gave a result: its declaration is false
    FAILED = "failed"  # its body ran and ended without a result
    CANCELLED = "cancelled"  # cancelled once its body may have begun
    ENDED = "ended"  # its server process ended while it was on its way or running


_SCHEMA = """
CREATE TABLE IF NOT EXISTS stopline_effects (
    key TEXT PRIMARY KEY,
    tool TEXT NOT NULL,
    state TEXT NOT NULL,
    result TEXT,
    detail TEXT NOT NULL DEFAULT '',
    cancel TEXT NOT NULL DEFAULT 'none',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS stopline_cancellations (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    request_id TEXT NOT NULL,
    key TEXT,
    tool TEXT,
    via TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS stopline_unrecorded (
    key TEXT PRIMARY KEY,
    tool TEXT NOT NULL,
    at REAL NOT NULL,
    ending TEXT NOT NULL DEFAULT 'answered'
);
CREATE TABLE IF NOT EXISTS stopline_arrivals (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL,
    tool TEXT NOT NULL,
    owner TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS stopline_arrivals_key ON stopline_arrivals (key);
"""


_PENDING = (EffectState.RECEIVED, EffectState.ACCEPTED, EffectState.COMMITTING)
# an ended process's unfinished claims: before the commit section never committed;
# inside it, nobody can tell
_RESOLVE = """
UPDATE stopline_effects SET
    state = CASE state WHEN 'committing' THEN 'unknown' ELSE 'not_committed' END,
    detail = 'the server process ended '
        || CASE state WHEN 'committing' THEN 'inside' ELSE 'before' END || ' the commit',
    updated_at = ?
WHERE owner = ? AND state IN (?, ?, ?)
"""


# the calls an ended process left on their way become marks (never over an earlier mark)
_ENDED_ARRIVALS = """
INSERT OR IGNORE INTO stopline_unrecorded (key, tool, at, ending)
SELECT key, tool, ?, ? FROM stopline_arrivals WHERE owner = ?
"""


@dataclasses.dataclass(frozen=True, slots=True)
class EffectRecord:
    key: str
    tool: str
    state: EffectState
    result: Any
    detail: str
    cancel: str
    updated_at: float


@dataclasses.dataclass(frozen=True, slots=True)
class Unrecorded:
    """A call of ``tool`` with the key ended (``ending``) and recorded nothing."""

    tool: str
    ending: Ending


@dataclasses.dataclass(frozen=True, slots=True)
class Evidence:
    """Everything the file holds of one key, read in one transaction."""

    record: EffectRecord | None
    unrecorded: Unrecorded | None  # a call that left no record (the first one read)
    arriving: bool  # a call with the key is on its way in a live server process on the file


class EffectStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.owner = _owner(os.getpid())
        db = sqlite3.connect(self.path, timeout=10)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
            columns = {row[1] for row in db.execute("PRAGMA table_info(stopline_effects)")}
            if "owner" not in columns:  # a file from before claims named their process
                db.execute("ALTER TABLE stopline_effects ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
            marks = {row[1] for row in db.execute("PRAGMA table_info(stopline_unrecorded)")}
            if "ending" not in marks:  # a file from before ADR 0067: every mark was an answer
                db.execute(
                    "ALTER TABLE stopline_unrecorded ADD COLUMN ending TEXT NOT NULL"
                    " DEFAULT 'answered'"
                )
        finally:
            db.close()

    @contextlib.contextmanager
    def _txn(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        finally:
            db.close()

    def get(self, key: str) -> EffectRecord | None:
        with self._txn() as db:
            return _current(db, key)

    def begin(self, key: str, tool: str, arrival: int | None = None) -> tuple[EffectRecord, bool]:
        """Claim ``key`` for a fresh attempt, or return what it already holds.

        Returns ``(record, fresh)``; a key that provably did not commit is
        claimed again (a retry with the same key is allowed to run). The call's
        ``arrival`` (``arrive``) ends in the same transaction: the record holds it now.
        """
        now = time.time()
        with self._txn() as db:
            if arrival is not None:
                db.execute("DELETE FROM stopline_arrivals WHERE id = ?", (arrival,))
            existing = _current(db, key)
            if existing is not None and existing.state is not EffectState.NOT_COMMITTED:
                return existing, False
            db.execute(
                "INSERT OR REPLACE INTO stopline_effects"
                " (key, tool, state, result, detail, cancel, created_at, updated_at, owner)"
                " VALUES (?, ?, ?, NULL, '', 'none', ?, ?, ?)",
                (key, tool, EffectState.RECEIVED.value, now, now, self.owner),
            )
            record = _get(db, key)
            assert record is not None
            return record, True

    def set_state(
        self, key: str, state: EffectState, *, result: Any = None, detail: str = ""
    ) -> None:
        try:
            text = _recordable(result)
        except pydantic_core.PydanticSerializationError as exc:  # the state is still the truth
            text, detail = "null", detail or f"its result has no JSON form ({exc})"
        if len(text) > MAX_RESULT_CHARS:  # as the ledger: the state, without the result
            text, detail = "null", detail or f"its result is {len(text):,} characters of JSON"
        with self._txn() as db:
            db.execute(
                "UPDATE stopline_effects SET state = ?, result = ?, detail = ?, updated_at = ?"
                " WHERE key = ?",
                (state.value, text, detail, time.time(), key),
            )

    def set_cancel(self, key: str, cancel: str) -> None:
        with self._txn() as db:
            db.execute("UPDATE stopline_effects SET cancel = ? WHERE key = ?", (cancel, key))

    def log_cancel(
        self, request_id: str, key: str | None, tool: str | None, via: str, state: str, reason: str
    ) -> None:
        with self._txn() as db:
            db.execute(
                "INSERT INTO stopline_cancellations (at, request_id, key, tool, via, state, reason)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (time.time(), request_id, key, tool, via, state, reason),
            )

    def arrive(self, key: str, tool: str) -> int:
        """A call of ``tool`` with ``key`` is on its way to the tool's body (before the body
        may run): until ``begin`` or ``settle`` ends it, every server on the file reads the
        key in flight, and after this process ends, as a call that left no record."""
        with self._txn() as db:
            row = db.execute(
                "INSERT INTO stopline_arrivals (key, tool, owner, at) VALUES (?, ?, ?, ?)",
                (key, tool, self.owner, time.time()),
            )
            assert row.lastrowid is not None
            return row.lastrowid

    def settle(self, arrival: int | None, key: str, tool: str, ending: Ending | None) -> bool:
        """A call that recorded nothing ended: its ``arrival`` ends, and unless it provably
        never reached the tool's body (``ending`` ``None``) the key is marked with how it
        ended, where no record holds the key (ADR 0063, 0067). Kept apart from
        ``stopline_effects``, so a later call with the key is not refused. Whether a record
        held the key."""
        with self._txn() as db:
            if arrival is not None:
                db.execute("DELETE FROM stopline_arrivals WHERE id = ?", (arrival,))
            held = _get(db, key) is not None
            if ending is not None and not held:
                db.execute(
                    "INSERT OR REPLACE INTO stopline_unrecorded (key, tool, at, ending)"
                    " VALUES (?, ?, ?, ?)",
                    (key, tool, time.time(), ending.value),
                )
        return held

    def evidence(self, key: str) -> Evidence:
        """The record of ``key``, the mark of a call that left none, and whether a call with
        it is on its way in a live process (one of an ended process reads as a mark)."""
        with self._txn() as db:
            record = _current(db, key)
            mark = db.execute(
                "SELECT tool, ending FROM stopline_unrecorded WHERE key = ?", (key,)
            ).fetchone()
            arrivals = db.execute(
                "SELECT tool, owner FROM stopline_arrivals WHERE key = ? ORDER BY id", (key,)
            ).fetchall()
        unrecorded = None if mark is None else Unrecorded(str(mark[0]), Ending(mark[1]))
        arriving = False
        for tool, owner in arrivals:
            if not _ended(owner):
                arriving = True
            elif unrecorded is None:
                unrecorded = Unrecorded(str(tool), Ending.ENDED)
        return Evidence(record, unrecorded, arriving)

    def cancellations(self) -> list[dict[str, Any]]:
        with self._txn() as db:
            rows = db.execute(
                "SELECT at, request_id, key, tool, via, state, reason"
                " FROM stopline_cancellations ORDER BY seq"
            ).fetchall()
        names = ("at", "request_id", "key", "tool", "via", "state", "reason")
        return [dict(zip(names, row, strict=True)) for row in rows]

    def recover(self) -> int:
        """At start: work a process that has ended left unfinished is resolved truthfully
        (one key at a time, as it is read, while this one runs: ``_current``).

        Before its commit section it never will commit (``not_committed``);
        inside it, nobody can tell (``unknown``). A live process's work, and a
        claim whose process cannot be judged here (another host), is left as it
        is: it reads as in doubt. Returns how many were resolved.
        """
        resolved = 0
        with self._txn() as db:
            owners = db.execute(
                "SELECT DISTINCT owner FROM stopline_effects WHERE state IN (?, ?, ?)", _PENDING
            ).fetchall()
            for (owner,) in owners:
                if _ended(owner):
                    resolved += db.execute(_RESOLVE, (time.time(), owner, *_PENDING)).rowcount
            arrived = db.execute("SELECT DISTINCT owner FROM stopline_arrivals").fetchall()
            for (owner,) in arrived:  # calls an ended process left on their way: marks now
                if _ended(owner):
                    db.execute(_ENDED_ARRIVALS, (time.time(), Ending.ENDED.value, owner))
                    db.execute("DELETE FROM stopline_arrivals WHERE owner = ?", (owner,))
        return resolved


def _current(db: sqlite3.Connection, key: str) -> EffectRecord | None:
    """``key``'s record as it is read or claimed: an unfinished claim whose process has
    ended (another server on the file, gone while this one runs) is resolved first, by
    the rule of ``recover``, not at the next start. One read for any other record."""
    record = _get(db, key)
    if record is None or record.state.terminal:
        return record
    (owner,) = db.execute("SELECT owner FROM stopline_effects WHERE key = ?", (key,)).fetchone()
    if not _ended(owner):
        return record
    db.execute(_RESOLVE + " AND key = ?", (time.time(), owner, *_PENDING, key))
    return _get(db, key)


def _owner(pid: int) -> str:
    return f"{socket.gethostname()}:{pid}:{_started(pid)}"


def _started(pid: int) -> str:
    """When ``pid`` started (clock ticks since boot, from ``/proc``), so that a reused
    pid is not taken for the process that made a claim; ``""`` where it cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""


def _ended(owner: str) -> bool:
    """Whether the process that made a claim has certainly ended. A claim from a file
    written before claims were named (``""``) is taken as ended, as it was then; a
    claim from another host cannot be judged here and is not."""
    if not owner:
        return True
    host, _, rest = owner.partition(":")
    pid_text, _, started = rest.partition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid != os.getpid() and os.name == "posix":  # signal 0 only asks; on Windows it kills
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # alive, another user's
    return bool(started) and _started(pid) != started  # the pid now names another process


def _recordable(result: Any) -> str:
    """A tool's result as the record keeps it: the JSON the MCP SDK writes of it.

    A pydantic model, a ``datetime``, a ``set`` as the SDK writes them, anything
    else as its ``str`` (the SDK's text fallback); a replay returns this JSON form.
    What has none (a cycle, bytes that are not UTF-8) raises, and its state is
    recorded without it.
    """
    return pydantic_core.to_json(result, fallback=str).decode()


def _get(db: sqlite3.Connection, key: str) -> EffectRecord | None:
    row = db.execute(
        "SELECT key, tool, state, result, detail, cancel, updated_at"
        " FROM stopline_effects WHERE key = ?",
        (key,),
    ).fetchone()
    if row is None:
        return None
    result = json.loads(row[3]) if row[3] is not None else None
    return EffectRecord(row[0], row[1], EffectState(row[2]), result, row[4], row[5], row[6])
