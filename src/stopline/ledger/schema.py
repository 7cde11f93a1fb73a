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

from stopline.domain.model import CancelState
from stopline.domain.vocab import OpStatus, RunEvent
from stopline.errors import LedgerCorrupt, SchemaTooNew, SchemaTooOld
from stopline.ledger.engine import guards
from stopline.ledger.engine.guards import sql_values

__all__ = [
    "CANCELLABLE_STATES",
    "DEFAULT_UNRESOLVED",
    "MIGRATIONS",
    "NOTHING_TO_RESUME",
    "OPEN_STATUSES",
    "OPEN_STATUSES_SQL",
    "READABLE_FROM",
    "SCHEMA_VERSION",
    "PostgresOnly",
    "SqliteOnly",
    "check_readable",
    "refuse_foreign",
]

# The status sets live with the engine's guards, generated from the domain; kept
# here under their old names for readers of the schema.
OPEN_STATUSES = guards.OPEN
OPEN_STATUSES_SQL = guards.OPEN_SQL  # the partial index ops_open's condition, verbatim
CANCELLABLE_STATES = guards.CANCELLABLE
NOTHING_TO_RESUME = guards.NOTHING_TO_RESUME
DEFAULT_UNRESOLVED = guards.DEFAULT_UNRESOLVED
_IN_FLIGHT_V1 = sql_values(
    (OpStatus.REQUESTED, OpStatus.ACCEPTED, OpStatus.UNKNOWN, OpStatus.COMPENSATING)
)
_CANCEL_NONE = sql_values([CancelState.NONE])

_V1 = f"""
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
    cancel_state TEXT NOT NULL DEFAULT {_CANCEL_NONE},
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
    WHERE status IN ({_IN_FLIGHT_V1});
CREATE TABLE events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    run_id TEXT NOT NULL,
    op_id TEXT,
    kind TEXT NOT NULL,
    from_state TEXT,
    to_state TEXT,
    data TEXT NOT NULL DEFAULT '{{}}'
);
CREATE INDEX events_run ON events(run_id, seq);
"""

# V2: lifecycle and truth. Ownership of shared children (R6), approvals (S5),
# evidenced checkpoints (R10), the worker that passed the gate and the
# workers' leases (crash recovery, R2), compensations linked to the operation
# they correct (S8), and review items in the open-operations index.
_V2 = f"""
ALTER TABLE operations ADD COLUMN compensates TEXT;
ALTER TABLE operations ADD COLUMN worker TEXT NOT NULL DEFAULT '';
CREATE INDEX ops_compensates ON operations(compensates) WHERE compensates IS NOT NULL;
DROP INDEX ops_open;
CREATE INDEX ops_open ON operations(status)
    WHERE status IN ({OPEN_STATUSES_SQL});
CREATE TABLE run_owners (
    run_id TEXT NOT NULL REFERENCES runs(id),
    owner_run TEXT NOT NULL REFERENCES runs(id),
    exclusive INTEGER NOT NULL,
    created_at REAL NOT NULL,
    released_at REAL,
    PRIMARY KEY (run_id, owner_run)
);
CREATE INDEX run_owners_owner ON run_owners(owner_run) WHERE released_at IS NULL;
CREATE TABLE approvals (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL REFERENCES runs(id),
    scope TEXT NOT NULL,
    approver TEXT NOT NULL,
    status TEXT NOT NULL,
    expires_at REAL,
    requested_by TEXT NOT NULL,
    decided_by TEXT,
    created_at REAL NOT NULL,
    decided_at REAL
);
CREATE INDEX approvals_run ON approvals(run_id, scope);
CREATE TABLE checkpoints (
    run_id TEXT NOT NULL REFERENCES runs(id),
    seq INTEGER NOT NULL,
    name TEXT NOT NULL,
    at REAL NOT NULL,
    state TEXT NOT NULL,
    evidence TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE workers (
    id TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    started_at REAL NOT NULL,
    heartbeat_at REAL NOT NULL,
    lease_until REAL NOT NULL
);
"""


class SqliteOnly(str):
    """A migration of SQLite's storage alone: PostgreSQL's tables need no such step, so
    there it records the new version and runs nothing."""

    __slots__ = ()


class PostgresOnly(str):
    """A migration of what PostgreSQL alone has (its notifications): SQLite records the
    new version and runs nothing."""

    __slots__ = ()


# V3: the log's sequence without AUTOINCREMENT (ADR 0035). AUTOINCREMENT keeps the
# highest seq ever used in ``sqlite_sequence`` and writes that page in every
# transaction that logs an event: one page of the seven a gated call wrote. The
# log is append-only (nothing deletes an event), so the largest seq is the
# highest ever used and a plain rowid key (largest + 1) hands out the same,
# strictly rising sequence. PostgreSQL's identity column has no such cost.
_V3 = SqliteOnly("""
CREATE TABLE events_v3 (
    seq INTEGER PRIMARY KEY,
    at REAL NOT NULL,
    run_id TEXT NOT NULL,
    op_id TEXT,
    kind TEXT NOT NULL,
    from_state TEXT,
    to_state TEXT,
    data TEXT NOT NULL DEFAULT '{}'
);
INSERT INTO events_v3 (seq, at, run_id, op_id, kind, from_state, to_state, data)
    SELECT seq, at, run_id, op_id, kind, from_state, to_state, data FROM events ORDER BY seq;
DROP TABLE events;
ALTER TABLE events_v3 RENAME TO events;
CREATE INDEX events_run ON events(run_id, seq);
""")

# V4: the cancel events indexed alone (SQLite). Another process's cancel reaches this
# one's calls through a poll (``sqlite_watch``) that asks for the cancel events
# logged since its last look; without an index of its own that walked every event
# logged since then (a sequential workflow's ~200 a poll: ~0.8 ms of CPU, growing
# with the write rate). The partial index holds only the cancel events: any other
# event's insert evaluates its condition and writes nothing to it. PostgreSQL's
# cancels come by NOTIFY and read nothing.
CANCEL_EVENT = RunEvent.CANCEL.value
_V4 = SqliteOnly(f"CREATE INDEX events_cancels ON events(seq) WHERE kind = '{CANCEL_EVENT}';")

# V5: the channel a PostgreSQL ledger's cancels are notified on, a random name kept in
# the ledger (ADR 0041). It was derived from the schema's name, so any role that could
# connect to the database could send a notification that looked like a cancel; the
# listener read every notified run back, and a run with a call awaiting its tool is now
# delivered without that read. Knowing the channel takes a read of the ledger. One row,
# made once (``gen_random_uuid``: PostgreSQL 13 and later); SQLite has no notifications.
_V5 = PostgresOnly("""
CREATE TABLE notify_channel (
    one BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (one),
    name TEXT NOT NULL
);
INSERT INTO notify_channel (name)
    VALUES ('stopline_cancel_' || replace(gen_random_uuid()::text, '-', ''))
""")

# V6: the runs by the time of their cancel (PostgreSQL). A listener whose connection
# dropped catches up with the runs cancelled since it last listened (``postgres_listen``);
# with no index on the time that read the state index's entry and the row of every run
# ever fenced (33 ms at 200,000 cancelled runs, growing with the history; and after a
# failover every process does it at once). Partial: a run never cancelled is not in it.
# SQLite's watch reads the cancel events (V4).
_V6 = PostgresOnly(
    "CREATE INDEX runs_cancelled ON runs(cancelled_at) WHERE cancelled_at IS NOT NULL"
)

# V7: the runs by the time they started, both engines. A listing of every run, newest
# first (``stopline runs``, the console's page, refreshed every 2 s), had no index to
# walk: it read every run of the ledger and sorted them for the newest 200 (35 ms at
# 200,000 runs on either engine, growing with the history). A run's start writes one
# entry more; a call writes nothing to it.
_V7 = "CREATE INDEX runs_created ON runs(created_at)"

MIGRATIONS: tuple[str, ...] = (_V1, _V2, _V3, _V4, _V5, _V6, _V7)
SCHEMA_VERSION = len(MIGRATIONS)

# The oldest schema a read-only open reads (it migrates nothing). The migrations after
# it add indexes only (a test holds that), so every read gives the same answer there,
# without the index's speed: a newer CLI or console reads a ledger its workers have not
# migrated yet, and a read-only role can read it at all. A migration that changes what
# a read reads (a table, a column, a row) moves this to its own version.
READABLE_FROM = 5


def refuse_foreign(location: str, version: int, tables: int) -> None:
    """Tables but no schema version: another program's database, never to be touched.

    ``version`` is the recorded schema version (0 when none), ``tables`` the number
    of tables found. Checked by a read before anything is written or switched.
    """
    if version == 0 and tables:
        raise LedgerCorrupt(location, "not a stopline ledger (foreign tables found)")


def check_readable(location: str, version: int, tables: int) -> None:
    """A read-only open accepts a ledger from ``READABLE_FROM`` to ``SCHEMA_VERSION``:
    it migrates nothing (``SchemaTooOld`` below, ``SchemaTooNew`` above)."""
    refuse_foreign(location, version, tables)
    if version == 0:
        raise LedgerCorrupt(location, "not a stopline ledger (an empty database)")
    if version > SCHEMA_VERSION:
        raise SchemaTooNew(location, version, SCHEMA_VERSION)
    if version < READABLE_FROM:
        raise SchemaTooOld(location, version, READABLE_FROM, SCHEMA_VERSION)
