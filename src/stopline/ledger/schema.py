"""The ledger schema and its ordered migrations.

The schema version lives in SQLite's ``user_version`` (PostgreSQL keeps it in
a one-row table). Migration N takes version N to N+1; a database whose
version is above ``SCHEMA_VERSION`` was written by a newer stopline and is
refused with ``SchemaTooNew`` before anything is written.

``events`` is the append-only log; ``runs`` and ``operations`` are the current
state, updated in the same transaction as the event that changed them. The
partial index ``ops_open`` lists in-flight and unknown operations, so crash
recovery never scans resolved history.
"""

from __future__ import annotations

__all__ = ["MIGRATIONS", "SCHEMA_VERSION"]

_V1 = """
CREATE TABLE runs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    owner TEXT NOT NULL,
    tenant TEXT NOT NULL,
    parent_id TEXT,
    state TEXT NOT NULL,
    fence INTEGER NOT NULL DEFAULT 0,
    grants INTEGER NOT NULL,
    phase TEXT,
    policy TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    cancelled_by TEXT,
    cancel_reason TEXT,
    cancelled_at REAL
);
CREATE INDEX runs_state ON runs(state, created_at);
CREATE INDEX runs_owner ON runs(owner, created_at);
CREATE TABLE operations (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL REFERENCES runs(id),
    tool TEXT NOT NULL,
    description TEXT NOT NULL,
    args_digest TEXT NOT NULL,
    status TEXT NOT NULL,
    cancellable TEXT NOT NULL,
    can_verify INTEGER NOT NULL,
    can_compensate INTEGER NOT NULL,
    cancel_state TEXT NOT NULL DEFAULT 'none',
    attempts INTEGER NOT NULL DEFAULT 0,
    result TEXT,
    has_result INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    cause TEXT,
    evidence TEXT NOT NULL DEFAULT '[]',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX ops_run ON operations(run_id, created_at);
CREATE INDEX ops_open ON operations(status)
    WHERE status IN ('requested', 'accepted', 'unknown', 'compensating');
CREATE TABLE events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    run_id TEXT NOT NULL,
    op_id TEXT,
    kind TEXT NOT NULL,
    from_state TEXT,
    to_state TEXT,
    data TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX events_run ON events(run_id, seq);
"""

MIGRATIONS: tuple[str, ...] = (_V1,)
SCHEMA_VERSION = len(MIGRATIONS)
