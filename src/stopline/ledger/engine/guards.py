"""Status guards for SQL, generated from the domain's enums and transition tables.

No status or state is typed into a SQL string anywhere in the ledger: each
guard below is a set of enum members (most derived from ``OPERATION_TABLE``
or ``RUN_TABLE``) and ``sql_values`` spells it as a SQL list. A test reads
every SQL string of the package and fails on a quoted word (see
``tests/ledger/test_engine_rules.py``).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping, Set
from typing import Any

from stopline.domain.transitions import OPERATION_TABLE, RUN_TABLE
from stopline.domain.vocab import OpEvent, OpStatus, RunEvent, RunState

__all__ = [
    "CANCELLABLE",
    "DEFAULT_UNRESOLVED",
    "FENCED",
    "IN_FLIGHT",
    "NOTHING_TO_RESUME",
    "OPEN",
    "OPEN_ORDER",
    "OPEN_SQL",
    "PAUSE_STATES",
    "RETRYABLE",
    "SETTLED",
    "SETTLING_SQL",
    "run_moves",
    "sql_values",
    "transition_case",
]


def sql_values(members: Iterable[enum.Enum]) -> str:
    """Enum members as a SQL list of string literals: ``'a', 'b'``.

    A set is spelled sorted; a sequence in its own order (an index's condition
    must be repeated verbatim for SQLite to use the index).
    """
    if isinstance(members, Set):
        values = sorted(m.value for m in members)
    else:
        values = [m.value for m in members]
    for value in values:
        if not str(value).replace("_", "").isalnum():
            raise ValueError(f"not a plain status word: {value!r}")
    return ", ".join(f"'{value}'" for value in values) or "NULL"


def _sources(table: Mapping[tuple[Any, Any], Any], event: enum.Enum) -> frozenset[Any]:
    return frozenset(s for (s, e) in table if e is event)


# Operations: what a crash can leave behind (every status with a `lost` move, R2, R3).
IN_FLIGHT: frozenset[OpStatus] = _sources(OPERATION_TABLE, OpEvent.LOST)
# What the gate may dispatch again under the same id: it provably never happened
# (not_committed), or the fence stopped it and the run was since resumed (prevented).
RETRYABLE: frozenset[OpStatus] = _sources(OPERATION_TABLE, OpEvent.GATE_PASSED) - {
    OpStatus.NOT_STARTED
}
# Settled for good (resolved, and waiting for no human): a checkpoint or a resume needs it.
SETTLED: frozenset[OpStatus] = frozenset(s for s in OpStatus if s.settled)
# The partial index ``ops_open``: everything not settled (in the order its DDL spells it).
OPEN_ORDER: tuple[OpStatus, ...] = (
    OpStatus.REQUESTED,
    OpStatus.ACCEPTED,
    OpStatus.UNKNOWN,
    OpStatus.COMPENSATING,
    OpStatus.NEEDS_REVIEW,
    OpStatus.COMPENSATION_FAILED,
)
OPEN: frozenset[OpStatus] = frozenset(OPEN_ORDER)
assert frozenset(OpStatus) - SETTLED - {OpStatus.NOT_STARTED} == OPEN, "ops_open drifted"
# What crash recovery and reconciliation look at by default.
DEFAULT_UNRESOLVED: frozenset[OpStatus] = IN_FLIGHT | {OpStatus.UNKNOWN, OpStatus.COMPENSATING}
OPEN_SQL = sql_values(OPEN_ORDER)  # the index's own condition, verbatim
# What a settling step reads of a run: ``settle_move`` looks at open statuses alone
# (tests/domain proves it for every set), and a cancel's compensation policy at the
# committed operations that can be compensated and are not corrections themselves.
SETTLING_SQL = (
    f"(status IN ({OPEN_SQL}) OR (status IN ({sql_values([OpStatus.COMMITTED])})"
    " AND can_compensate = 1 AND compensates IS NULL))"
)

# Runs: a cancel fences these (the sources of `cancel`); R7: any other, the first won.
CANCELLABLE: frozenset[RunState] = _sources(RUN_TABLE, RunEvent.CANCEL)
PAUSE_STATES: frozenset[RunState] = frozenset(s for s in RunState if s.paused)
# Where a cancel leads, short of a resume: the run is fenced.
FENCED: frozenset[RunState] = frozenset(s for s in RunState if s.fenced)
# A resume of these is a no-op: running already, or ended on its own.
NOTHING_TO_RESUME: frozenset[RunState] = frozenset(
    {RunState.RUNNING, RunState.COMPLETED, RunState.FAILED}
)


@functools.cache
def transition_case(event: OpEvent, column: str) -> tuple[str, str]:
    """``(guard, target)`` of ``event`` over the operation table, as SQL.

    ``guard`` is ``column IN (sources)``; ``target`` a ``CASE`` giving each
    source's next status: storage and domain cannot disagree.
    """
    moves = {s: t for (s, e), t in OPERATION_TABLE.items() if e is event}
    guard = f"{column} IN ({sql_values(moves)})"
    cases = " ".join(f"WHEN {sql_values([s])} THEN {sql_values([t])}" for s, t in moves.items())
    return guard, (f"CASE {column} {cases} END" if moves else column)


@functools.cache
def run_moves(state: str, kind: RunEvent) -> tuple[str, str] | None:
    """The run table's moves by ``kind`` in SQL, on ``state`` (the column as the dialect
    keeps it off its index: the id's own serves): each state's target (a ``CASE``),
    and the condition matching the states it moves; None if it moves none."""
    moves = {source: target for (source, event), target in RUN_TABLE.items() if event is kind}
    if not moves:
        return None
    whens = " ".join(f"WHEN '{s.value}' THEN '{t.value}'" for s, t in sorted(moves.items()))
    return f"CASE {state} {whens} END", f"{state} IN ({sql_values(set(moves))})"
