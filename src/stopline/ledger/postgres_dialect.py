"""PostgreSQL's spellings, and its one-round-trip forms of the hot statements.

Row locks (``FOR UPDATE``/``FOR SHARE``), a list as one array parameter, the
server's clock for leases (a paused worker cannot pass a stale "now"), and
three fused statements built from the engine's fragments: the gate's intent
with its event (the run taken ``FOR SHARE``), ``record``'s compare-and-set
with its event, and the cancel's ``NOTIFY`` (sent by the server at commit,
never for a cancel that rolled back).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Sequence
from typing import Any

from stopline.domain.vocab import OpEvent
from stopline.ledger import rows
from stopline.ledger.engine.db import Db
from stopline.ledger.engine.dialect import OUTCOME_SET, Dialect
from stopline.ledger.engine.guards import transition_case

__all__ = ["NOTIFY_CHUNK", "PostgresDialect"]

NOTIFY_CHUNK = 100  # run ids per notification: well under the 8000-byte payload limit
_UPD_COLUMNS = ", ".join(f"upd.{c.strip()}" for c in rows.OP_COLUMNS.split(","))


class PostgresDialect(Dialect):
    name = "postgresql"
    for_update = " FOR UPDATE"
    for_share = " FOR SHARE"
    now = "extract(epoch from clock_timestamp())"

    def __init__(self, channel: str | None) -> None:
        self.channel = channel  # where cancels are notified; None: nobody listens

    def in_list(self, column: str, values: Collection[Any]) -> tuple[str, list[Any]]:
        return f"{column} = ANY(?)", [list(values)]

    def json_int(self, column: str, key: str) -> str:
        return f"({column}::jsonb ->> '{key}')::int"

    def text(self, placeholder: str) -> str:
        return f"{placeholder}::text"

    def indexed_by(self, index: str) -> str:
        return ""

    async def notify_cancel(self, db: Db, run_ids: Sequence[str]) -> None:
        if self.channel is None:
            return
        for i in range(0, len(run_ids), NOTIFY_CHUNK):
            payload = json.dumps(list(run_ids[i : i + NOTIFY_CHUNK]), separators=(",", ":"))
            await db.run("SELECT pg_notify(?, ?)", (self.channel, payload))

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
WITH old AS (SELECT id, status, run_id, evidence FROM operations WHERE id = :id FOR UPDATE),
upd AS (
    UPDATE operations o SET status = {target}, {OUTCOME_SET.format(old="old.", new="o.")}
    FROM old WHERE o.id = old.id AND {guard}
    RETURNING old.status AS source, o.*
),
ev AS (
    INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)
    SELECT :now, upd.run_id, upd.id, :kind, upd.source, upd.status, :data FROM upd
)
SELECT old.status, upd.id IS NOT NULL, {_UPD_COLUMNS}
FROM old LEFT JOIN upd ON true
"""
