"""What differs per SQL engine, and nothing more.

The base class is the portable form (SQLite speaks it): no row locks (one
writer is the lock), a list parameter as ``IN (?, ?)``, the local clock, and
the hot statements (the gate's intent, ``record``) as a few statements each.
A dialect may override a hot statement with a one-round-trip form, built
from the same fragments (the eligibility ``WHERE`` of the gate, the guard
and target of ``guards.transition_case``): a fused form re-spells how, never
what. PostgreSQL's is in ``stopline.ledger.postgres_dialect``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Sequence
from typing import Any

from stopline.domain.vocab import OpEvent, RunEvent
from stopline.ledger import rows
from stopline.ledger.engine.db import Db, Params
from stopline.ledger.engine.guards import transition_case
from stopline.ledger.engine.reads import EVENT_SQL

__all__ = ["OUTCOME_SET", "SAME_ATTEMPT", "Dialect"]

# The columns ``record`` sets besides the status (``{col}`` is the old row's alias).
OUTCOME_SET = (
    "updated_at = :now,"
    " evidence = CASE WHEN CAST(:items AS TEXT) IS NULL THEN {old}evidence"
    " WHEN {old}evidence = '[]' THEN '[' || :items || ']'"
    " ELSE substr({old}evidence, 1, length({old}evidence) - 1) || ',' || :items || ']' END,"
    " cause = COALESCE(:cause, {new}cause), error = COALESCE(:error, {new}error),"
    " result = CASE WHEN :has_result = 1 THEN :result ELSE {new}result END,"
    " has_result = CASE WHEN :has_result = 1 THEN 1 ELSE {new}has_result END,"
    " cancel_state = COALESCE(:cancel_state, {new}cancel_state)"
)

# ``record``'s guard besides the status: a read-back's verdict (``OutcomeUpdate.attempt``)
# moves the operation only while no later attempt has been sent (ADR 0099)
SAME_ATTEMPT = "(CAST(:attempt AS INTEGER) IS NULL OR {old}attempts = CAST(:attempt AS INTEGER))"

_OP_BY_ID = f"SELECT {rows.OP_COLUMNS} FROM operations WHERE id = :id"


@functools.cache
def _outcome_update(event: OpEvent, which: str = "= :id") -> str:
    """``record``'s portable compare-and-set for ``event`` (the guard and target derived
    from the operation table), of the operation ``id {which}``."""
    guard, target = transition_case(event, "status")
    return (
        f"UPDATE operations SET status = {target}, {OUTCOME_SET.format(old='', new='')}"
        f" WHERE id {which} AND {guard} AND {SAME_ATTEMPT.format(old='')}"
    )


# beyond this many values ``Dialect.in_list`` passes one JSON array (ADR 0044); a short
# list keeps a parameter per value, and the plans its statements were measured with
LONG_LIST = 64


def _each(array: str) -> str:
    """The values of the JSON array bound to the parameter ``array``, as a subquery."""
    return f"(SELECT value FROM json_each({array}))"


_IDS = _each(":ids")
_OPS_BY_IDS = f"SELECT {rows.OP_COLUMNS} FROM operations WHERE id IN {_IDS}"


@functools.cache
def _outcomes_sql(event: OpEvent) -> tuple[str, str, str]:
    """``record``'s portable compare-and-set for many operations with the same update
    (``:ids``, a JSON array): the statuses read, the events logged (before the rows
    change: each reads its source status) returning the operations that moved, and
    the update. The same guard, target and ``OUTCOME_SET`` as for one."""
    guard, target = transition_case(event, "o.status")
    read = f"SELECT id, status FROM operations WHERE id IN {_IDS}"
    log = (
        f"{rows.EVENT_INTO} SELECT :now, o.run_id, o.id, :kind, o.status, {target}, :data"
        " FROM json_each(:ids) AS j CROSS JOIN operations o ON o.id = j.value"
        f" WHERE {guard} AND {SAME_ATTEMPT.format(old='o.')} ORDER BY j.key RETURNING op_id"
    )
    return read, log, _outcome_update(event, f"IN {_IDS}")


class Dialect:
    """The portable SQL forms; a backend's dialect overrides what its engine says better."""

    name = "sqlite"
    for_update = ""  # a row lock (with its leading space), where the engine has them
    for_share = ""
    # the ledger's clock for leases: the server's where there is one (fencing)
    now = "((julianday('now') - 2440587.5) * 86400.0)"
    # a mark that moves with every commit (``Backend.change_mark``): here the log's
    # last sequence number, handed out in commit order by the one writer at a time
    change_mark = "SELECT COALESCE(MAX(seq), 0) FROM events"

    def in_list(self, column: str, values: Collection[Any]) -> tuple[str, list[Any]]:
        """``column`` is one of ``values``, with its positional parameters. A long list
        goes as one JSON array (ADR 0044): SQLite caps a statement's parameters (32,766
        in its default build), and a tree's fence names every run of the tree."""
        if len(values) > LONG_LIST:
            return f"{column} IN {_each('?')}", [json.dumps(list(values))]
        return f"{column} IN ({', '.join('?' * len(values))})", list(values)

    def each_of(self, values: Collection[str]) -> tuple[str, list[Any]]:
        """A row source of ``values`` (texts), one row each, its one column ``value``,
        with its parameters: one array, whatever their number."""
        return "json_each(?)", [json.dumps(list(values))]

    def in_rows(self, column: str, subquery: str) -> str:
        """``column`` is one of the values ``subquery`` (one column) returns."""
        return f"{column} IN ({subquery})"

    def owned_step(self, carry: str = "") -> str:
        """The recursive step of a ``tree`` (its column ``id``) to the runs the runs in it
        own exclusively, each ``o.run_id`` after ``carry`` (the columns passed on, with
        their comma). Exclusive ownership is never released; saying so lets the partial
        index serve."""
        return (
            f" UNION SELECT {carry}o.run_id FROM run_owners o JOIN tree ON o.owner_run = tree.id"
            " WHERE o.exclusive = 1 AND o.released_at IS NULL"
        )

    def json_int(self, column: str, key: str) -> str:
        """The integer under ``key`` of a JSON text column."""
        return f"json_extract({column}, '$.{key}')"

    def text(self, placeholder: str) -> str:
        """A parameter whose type the statement does not say (PostgreSQL must be told)."""
        return placeholder

    def indexed_by(self, index: str) -> str:
        """Insist on a partial index (SQLite); the planner's own choice elsewhere."""
        return f" INDEXED BY {index}"

    def unindexed(self, column: str) -> str:
        """``column`` where it must not choose the index: SQLite, without statistics,
        takes ``state IN`` three values as cheaper than ``id IN`` a thousand ids and
        walks every live run of the ledger; ``+column`` (a no-op) leaves its index out,
        so a tree's statements cost what the tree holds, not what the ledger does."""
        return f"+{column}"

    def create_sql(self, insert: str, then: Sequence[str]) -> str | None:
        """``runs.create_run`` as one statement: ``insert`` (the new run's row), then each
        of ``then`` (a child's link, the event: inserts whose ``SELECT`` lacks its
        ``FROM``) taking the new row from it, returning the row (none if a child's
        parent is not there). None where the engine cannot (SQLite: its transaction is
        the writer's, and costs no round trip)."""
        return None

    def move_sql(self, kind: RunEvent) -> str | None:
        """A run's move by ``kind`` as one statement (``:run``, ``:now``, ``:kind``,
        ``:data``): the run locked and read, its event and its move, returning the run's
        row as read. None: the engine writes it in three statements (``runs``), or no
        state moves by ``kind``."""
        return None

    async def notify_cancel(self, db: Db, run_ids: Sequence[str]) -> None:
        """Tell other processes these runs were fenced, at commit (nothing here)."""

    def fused(self, writes: Sequence[tuple[str, Params]]) -> list[tuple[str, Params]]:
        """``writes`` (none needing another's result; only the last returning rows) as
        few statements as the engine can: here as they are (SQLite runs them in its
        writer's transaction, at no round trip's cost)."""
        return list(writes)

    def notify_fenced(self, run_id: str, where: str, params: Params) -> list[tuple[str, Params]]:
        """The statements telling other processes ``run_id`` was fenced if ``where``
        picks it from ``runs`` (read before it changes; sent at commit): none here."""
        return []

    async def record_intent(
        self, db: Db, where: str, values: str, params: dict[str, Any]
    ) -> int | None:
        """The gate's conditional insert and its ``gate_passed`` event; the fence, if it passed.

        ``where`` picks the run that may take the intent, ``values`` is the row.
        """
        inserted = await db.run(
            f"INSERT INTO operations ({rows.OP_COLUMNS}) SELECT {values} FROM runs"
            f" WHERE {where} ON CONFLICT (id) DO NOTHING",
            params,
        )
        if inserted != 1:
            return None
        attempt = "" if params["token"] is None else ", 'attempt', :token"
        await db.run(
            f"{rows.EVENT_INTO} SELECT :now, id, :id, :passed, :from, :to,"
            f" json_object('fence', fence{attempt}) FROM runs WHERE id = :run",
            params,
        )
        # read apart: on SQLite a RETURNING clause costs more than the statement (issue 18)
        return int((await db.one("SELECT fence FROM runs WHERE id = :run", params))[0])

    async def apply_outcome(
        self, db: Db, event: OpEvent, params: dict[str, Any]
    ) -> tuple[str | None, Sequence[Any] | None]:
        """``record``'s compare-and-set: (the status read, the updated row or None)."""
        found = await db.one("SELECT status, run_id FROM operations WHERE id = :id", params)
        if found is None:
            return None, None
        if not await db.run(_outcome_update(event), params):
            return found[0], None
        # the row read apart: on SQLite, RETURNING here cost ~2x the update (issue 18)
        row = await db.one(_OP_BY_ID, params)
        values = (params["now"], found[1], params["id"], params["kind"], found[0], row[5])
        await db.run(EVENT_SQL, (*values, params["data"]))
        return found[0], row

    async def apply_outcomes(
        self, db: Db, event: OpEvent, many: Sequence[dict[str, Any]]
    ) -> list[tuple[str | None, Sequence[Any] | None]]:
        """``apply_outcome`` for many operations (distinct ids), in order, each one's
        pair. Those with the same update (a tree's interrupted calls) in a fixed number
        of statements however many they are; one alone as one."""
        groups: dict[tuple[Any, ...], list[str]] = {}
        for params in many:
            key = tuple((k, v) for k, v in params.items() if k != "id")
            groups.setdefault(key, []).append(params["id"])
        found: dict[str, tuple[str | None, Sequence[Any] | None]] = {}
        for key, ids in groups.items():
            if len(ids) == 1:
                found[ids[0]] = await self.apply_outcome(db, event, {**dict(key), "id": ids[0]})
                continue
            bound = {**dict(key), "ids": json.dumps(ids)}
            read, log, update = _outcomes_sql(event)
            sources = dict(await db.all(read, bound))
            moved = {op_id for (op_id,) in await db.all(log, bound)}
            await db.run(update, bound)
            after = {row[0]: row for row in await db.all(_OPS_BY_IDS, bound)} if moved else {}
            for op_id in ids:
                found[op_id] = (sources.get(op_id), after.get(op_id) if op_id in moved else None)
        return [found[params["id"]] for params in many]
