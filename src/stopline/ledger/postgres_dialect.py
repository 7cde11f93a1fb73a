"""PostgreSQL's spellings, and its one-round-trip forms of the hot statements.

Row locks (``FOR UPDATE``/``FOR SHARE``), a list as one array parameter, the
server's clock for leases (a paused worker cannot pass a stale "now"), and
three fused statements built from the engine's fragments: the gate's intent
with its event (the run taken ``FOR SHARE``), ``record``'s compare-and-set
with its event, and the cancel's ``NOTIFY`` (sent by the server at commit,
never for a cancel that rolled back; queued on the transaction and sent with
its ``COMMIT``, one round trip for all of them, in payloads cut by size: the
server refuses one of 8000 bytes or more).

The group commit (``postgres_batch``) runs the first two for many operations
in one statement each: the same fragments with every ``:name`` parameter read
from a row ``req`` of one JSON parameter holding every operation's parameters
(``many_rows``), so the rule is still written once and only its spelling
differs.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

from stopline.domain import jsontext
from stopline.domain.vocab import OpEvent, RunEvent
from stopline.ledger import rows
from stopline.ledger.engine.db import Db, Params
from stopline.ledger.engine.dialect import OUTCOME_SET, SAME_ATTEMPT, Dialect
from stopline.ledger.engine.guards import run_moves, transition_case

__all__ = ["NOTIFY_BYTES", "Forms", "PostgresDialect", "gate_forms", "many_rows", "outcome_forms"]

# how many of the log's last numbers ``change_mark`` sums: a commit that lands late is
# seen at once if fewer than this many higher numbers committed before it (a
# transaction commits milliseconds after its last event; 1,000 events is a fifth of a
# second at 5,000 a second)
MARK_WINDOW = 1000
NOTIFY_BYTES = 7999  # the most a notification's payload may hold (the server's limit: < 8000)
_UPD_COLUMNS = ", ".join(f"upd.{c.strip()}" for c in rows.OP_COLUMNS.split(","))


class PostgresDialect(Dialect):
    name = "postgresql"
    for_update = " FOR UPDATE"
    for_share = " FOR SHARE"
    now = "extract(epoch from clock_timestamp())"
    # the log's last sequence number, and the sum of the last ``MARK_WINDOW`` numbers
    # committed. Numbers are taken at insert and transactions commit out of their order,
    # so one that took a lower number can commit after a higher one was read: its
    # number then enters the last ones, displacing a lower one, and the sum grows. Only
    # this ledger's commits move it (the server's WAL position, the mark before, moved
    # with every database's commits); a commit whose number is not among the last
    # ``MARK_WINDOW`` when it lands is read by a waiter's 5 s read regardless
    change_mark = (
        "SELECT COALESCE(MAX(seq), 0)::text || ':' || COALESCE(SUM(seq), 0)::text"
        f" FROM (SELECT seq FROM events ORDER BY seq DESC LIMIT {MARK_WINDOW}) AS recent"
    )

    def __init__(self, channel: str | None) -> None:
        self.channel = channel  # where cancels are notified; None: nobody listens

    def in_list(self, column: str, values: Collection[Any]) -> tuple[str, list[Any]]:
        if len(values) == 1:  # most cancels: a value costs the client less than an array
            return f"{column} = ?", list(values)
        return f"{column} = ANY(?)", [list(values)]

    def each_of(self, values: Collection[str]) -> tuple[str, list[Any]]:
        return "unnest(?::text[]) AS each_of(value)", [list(values)]

    def in_rows(self, column: str, subquery: str) -> str:
        # as an array, not a semi join: on a table it has not analyzed (a new ledger, or
        # autovacuum off) the planner takes a semi join's rows for 5% of the table and
        # scans it all (a run's receipt read every operation of the ledger: 46 ms at
        # 90,000); an array made first is looked up through the column's index
        return f"{column} = ANY(ARRAY({subquery}))"

    def owned_step(self, carry: str = "") -> str:
        # each run of the tree looks its owned runs up through the index, as a subplan:
        # as a join, on tables it has not analyzed, the planner guesses a few live
        # ownerships and hashes them all (every exclusive one ever made: 60,000 read for
        # the trees of 200 runs, 33 ms, growing with the history)
        return (
            f" UNION SELECT {carry}o.run_id FROM tree, unnest(ARRAY(SELECT r.run_id"
            " FROM run_owners r WHERE r.owner_run = tree.id AND r.exclusive = 1"
            " AND r.released_at IS NULL)) AS o(run_id)"
        )

    def json_int(self, column: str, key: str) -> str:
        return f"({column}::jsonb ->> '{key}')::int"

    def text(self, placeholder: str) -> str:
        return f"{placeholder}::text"

    def indexed_by(self, index: str) -> str:
        return ""

    def unindexed(self, column: str) -> str:
        # the planner, on tables it has not analyzed yet, ties the state index with the
        # primary key and may walk every live run: ``|| ''`` leaves the index out
        return f"({column} || '')"

    def fused(self, writes: Sequence[tuple[str, Params]]) -> list[tuple[str, Params]]:
        # one statement: the first writes as data-modifying CTEs (each runs, and all read
        # the statement's one snapshot, as the batch's did before any of them wrote),
        # the last as its body, whose rows it returns; it lands whole or not at all
        *first, (last, last_params) = writes
        if not first:
            return [(last, last_params)]
        params = [value for _, p in first for value in _positional(p)]
        text = _fused_text(tuple(sql for sql, _ in first), last)
        return [(text, [*params, *_positional(last_params)])]

    def create_sql(self, insert: str, then: Sequence[str]) -> str | None:
        return _create_sql(insert, tuple(then))

    def move_sql(self, kind: RunEvent) -> str | None:
        return _move_sql(kind)

    async def notify_cancel(self, db: Db, run_ids: Sequence[str]) -> None:
        if self.channel is None:
            return
        at_commit = getattr(db, "at_commit", None)  # Tx's: sent with the COMMIT
        for payload in notify_payloads(run_ids):
            params = (self.channel, payload)
            if at_commit is not None:
                await at_commit("SELECT pg_notify(?, ?)", params)
            else:
                await db.run("SELECT pg_notify(?, ?)", params)

    def notify_fenced(self, run_id: str, where: str, params: Params) -> list[tuple[str, Params]]:
        if self.channel is None:
            return []
        (payload,) = notify_payloads([run_id])
        return [
            ("SELECT pg_notify(?, ?) FROM runs WHERE " + where, (self.channel, payload, *params))
        ]

    async def record_intent(
        self, db: Db, where: str, values: str, params: dict[str, Any]
    ) -> int | None:
        row = await db.commit_one(_intent_sql(where, values), params)
        return None if row is None else int(row[0])

    async def apply_outcome(
        self, db: Db, event: OpEvent, params: dict[str, Any]
    ) -> tuple[str | None, Sequence[Any] | None]:
        row = await db.commit_one(_outcome_sql(event), params)
        if row is None:
            return None, None
        return row[0], (row[2:] if row[1] else None)

    async def apply_outcomes(
        self, db: Db, event: OpEvent, many: Sequence[dict[str, Any]]
    ) -> list[tuple[str | None, Sequence[Any] | None]]:
        if len(many) == 1:
            return [await self.apply_outcome(db, event, many[0])]
        found = await db.all(outcomes_sql(event), many_rows(many))
        return [(row[0], row[2:] if row[1] else None) for row in found]


def notify_payloads(run_ids: Sequence[str]) -> list[str]:
    """``run_ids`` as JSON arrays of at most ``NOTIFY_BYTES`` bytes each, in order (an id
    is at most 1,024 characters, ~4 KB in UTF-8: one always fits)."""
    payloads: list[str] = []
    items: list[str] = []
    size = 2  # the brackets
    for run_id in run_ids:
        item = json.dumps(run_id, ensure_ascii=False)
        grown = len(item.encode()) + (1 if items else 0)
        if items and size + grown > NOTIFY_BYTES:
            payloads.append("[" + ",".join(items) + "]")
            items, size, grown = [], 2, grown - 1
        items.append(item)
        size += grown
    if items:
        payloads.append("[" + ",".join(items) + "]")
    return payloads


@functools.cache
def _intent_sql(where: str, values: str) -> str:
    """The gate as one statement: fence check, intent and event, one round trip, one commit."""
    runs_values = values.replace("runs.id", "run.id")
    return f"""
WITH run AS (SELECT id, fence FROM runs WHERE {where} FOR SHARE OF runs),
ins AS (
    INSERT INTO operations ({rows.OP_COLUMNS})
    SELECT {runs_values} FROM run ON CONFLICT (id) DO NOTHING RETURNING run_id
)
INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)
SELECT :now, ins.run_id, :id, :passed, :from, :to,
    json_build_object('fence', run.fence, 'attempt', :token::text)::text
FROM ins CROSS JOIN run RETURNING (SELECT fence FROM run)
"""


@functools.cache
def _outcome_sql(event: OpEvent) -> str:
    """``record`` as one statement: the guard and target from the table, and the event."""
    guard, target = transition_case(event, "old.status")
    return f"""
WITH old AS (
    SELECT id, status, run_id, evidence, attempts FROM operations WHERE id = :id FOR UPDATE
),
upd AS (
    UPDATE operations o SET status = {target}, {OUTCOME_SET.format(old="old.", new="o.")}
    FROM old WHERE o.id = old.id AND {guard} AND {SAME_ATTEMPT.format(old="old.")}
    RETURNING old.status AS source, o.*
),
ev AS (
    INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)
    SELECT :now, upd.run_id, upd.id, :kind, upd.source, upd.status, :data FROM upd
)
SELECT old.status, upd.id IS NOT NULL, {_UPD_COLUMNS}
FROM old LEFT JOIN upd ON true
"""


@functools.lru_cache(maxsize=16)
def _fused_text(first: tuple[str, ...], last: str) -> str:
    """The writes ``first`` as data-modifying CTEs of ``last``: made once per shape."""
    ctes = ", ".join(f"w{i} AS ({sql})" for i, sql in enumerate(first))
    return f"WITH {ctes} {last}"


def _positional(params: Params) -> Sequence[Any]:
    if isinstance(params, dict):
        raise TypeError("only statements with positional parameters are fused")
    return params


@functools.cache
def _create_sql(insert: str, then: tuple[str, ...]) -> str:
    """``runs.create_run`` as one statement that commits whole by itself: the row, then
    what follows it (a child's link, the event) from the row the CTE returns; the row
    returned (its ``BEGIN``, read-back and ``COMMIT`` saved, and a child's round trip
    locking its parent)."""
    follow = "".join(f",\nw{i} AS ({sql} FROM run)" for i, sql in enumerate(then))
    return f"""
WITH run AS ({insert} RETURNING {rows.RUN_COLUMNS}){follow}
SELECT * FROM run
"""


@functools.cache
def _move_sql(kind: RunEvent) -> str | None:
    """``runs.run_event`` as one statement: the run locked and read, the event (from the
    state read) and the move, both matching only a state the run table moves by
    ``kind`` (``guards.run_moves``); the row as read. One statement commits whole by
    itself, alone or in a group's implicit transaction."""
    moves = run_moves("run.state", kind)
    if moves is None:
        return None
    target_of, movable = moves
    return f"""
WITH run AS (SELECT {rows.RUN_COLUMNS} FROM runs WHERE id = :run FOR UPDATE),
ev AS (
    INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)
    SELECT :now, run.id, NULL, :kind::text, run.state, {target_of}, :data::text
    FROM run WHERE {movable}
),
upd AS (
    UPDATE runs SET state = {target_of}, updated_at = :now FROM run
    WHERE runs.id = run.id AND {movable}
)
SELECT * FROM run
"""


# -- many operations per statement (the group commit) ---------------------------------
class Forms(NamedTuple):
    """A hot statement for the group commit: for one operation (the engine's
    placeholders) and for many (one JSON parameter); ``gate``: the gate's, else
    ``record``'s, of ``event``."""

    one: str
    many: str
    gate: bool
    event: OpEvent | None = None


@functools.cache
def gate_forms(where: str, values: str) -> Forms:
    return Forms(_intent_sql(where, values), intents_sql(where, values), True)


@functools.cache
def outcome_forms(event: OpEvent) -> Forms:
    return Forms(_outcome_sql(event), outcomes_sql(event), False, event)


_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")
# the SQL type of each parameter of the gate and of ``record`` (``gate_params``,
# ``record_params``), for the arrays they travel in
GATE_TYPES = {
    "id": "text", "run": "text", "tool": "text", "description": "text", "digest": "text",
    "cancellable": "text", "can_verify": "int", "can_compensate": "int",
    "cancel_none": "text", "evidence": "text", "now": "float8", "compensates": "text",
    "worker": "text", "token": "text", "passed": "text", "from": "text", "to": "text",
}  # fmt: skip
RECORD_TYPES = {
    "id": "text", "now": "float8", "items": "text", "cause": "text", "error": "text",
    "has_result": "int", "result": "text", "cancel_state": "text", "kind": "text",
    "data": "text", "attempt": "int",
}  # fmt: skip


def _per_row(sql: str) -> str:
    """A fragment written for one operation's ``:name`` parameters, reading them from
    the row ``req`` instead (``req."name"``)."""
    return _PARAM.sub(r'req."\1"', sql)


def _req(types: dict[str, str]) -> str:
    columns = ", ".join(f'"{name}" {kind}' for name, kind in types.items())
    names = ", ".join(f'"{name}"' for name in types)
    return (
        "req AS (SELECT * FROM ROWS FROM (json_to_recordset(:rows::json)"
        f" AS ({columns})) WITH ORDINALITY AS req({names}, ord))"
    )


def many_rows(rows_: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The parameters of a ``*_many`` statement: each operation's, as one JSON array."""
    return {"rows": jsontext.compact(rows_)}


@functools.cache
def intents_sql(where: str, values: str) -> str:
    """``_intent_sql`` for many gates: the operation id and fence of each that passed.

    The run of each is taken ``FOR SHARE`` (one lock per gate, as alone), skipping a
    run locked by a cancel (or any write of runs) rather than waiting for it while
    holding the others: that gate, like one that did not pass, wrote nothing and
    takes the slow path on its own."""
    runs_values = _per_row(values.replace("runs.id", "run.id"))
    return f"""
WITH {_req(GATE_TYPES)},
run AS (
    SELECT req."id" AS op, l.id, l.fence FROM req CROSS JOIN LATERAL
    (SELECT id, fence FROM runs WHERE {_per_row(where)} FOR SHARE OF runs SKIP LOCKED) l
),
ins AS (
    INSERT INTO operations ({rows.OP_COLUMNS})
    SELECT {runs_values} FROM run JOIN req ON req."id" = run.op ORDER BY req.ord
    ON CONFLICT (id) DO NOTHING RETURNING id
),
ev AS (
    INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)
    SELECT req."now", run.id, ins.id, req."passed", req."from", req."to",
        json_build_object('fence', run.fence, 'attempt', req."token")::text
    FROM ins JOIN req ON req."id" = ins.id JOIN run ON run.op = ins.id ORDER BY req.ord
    RETURNING op_id, data
)
SELECT op_id, (data::jsonb ->> 'fence')::int FROM ev
"""


@functools.cache
def outcomes_sql(event: OpEvent) -> str:
    """``_outcome_sql`` for many operations (one event): per operation, in order, the
    status read, whether it moved, and the updated row."""
    guard, target = transition_case(event, "old.status")
    sets = _per_row(OUTCOME_SET.format(old="old.", new="o."))
    same = _per_row(SAME_ATTEMPT.format(old="old."))
    return f"""
WITH {_req(RECORD_TYPES)},
old AS (
    SELECT id, status, run_id, evidence, attempts FROM operations
    WHERE id = ANY(ARRAY(SELECT "id" FROM req)) ORDER BY id FOR UPDATE
),
upd AS (
    UPDATE operations o SET status = {target}, {sets}
    FROM old JOIN req ON req."id" = old.id WHERE o.id = old.id AND {guard} AND {same}
    RETURNING old.status AS source, req.ord, o.*
),
ev AS (
    INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)
    SELECT req."now", upd.run_id, upd.id, req."kind", upd.source, upd.status, req."data"
    FROM upd JOIN req ON req."id" = upd.id ORDER BY upd.ord
)
SELECT old.status, upd.id IS NOT NULL, {_UPD_COLUMNS}
FROM req LEFT JOIN old ON old.id = req."id" LEFT JOIN upd ON upd.id = req."id" ORDER BY req.ord
"""
