"""Rows to records and back: the one place the ledger's text columns are decoded."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from stopline.domain import jsontext
from stopline.domain.lifecycle import ApprovalRecord, ApprovalStatus
from stopline.domain.limits import MAX_RESULT_CHARS
from stopline.domain.model import (
    NOT_REPLAYABLE,
    CancelState,
    EventRecord,
    Evidence,
    LazyEvidence,
    OperationRecord,
    RunRecord,
    result_digest,
)
from stopline.domain.vocab import (
    Cancellable,
    Cause,
    Grant,
    OpStatus,
    PhaseKind,
    Policy,
    RunState,
    by_value,
)
from stopline.errors import InvalidInput, LedgerCorrupt, describe
from stopline.ledger.leases import WorkerLease

__all__ = [
    "APPROVAL_COLUMNS",
    "OP_COLUMNS",
    "RUN_COLUMNS",
    "LazyEvidence",
    "approval_from_row",
    "dump_evidence",
    "dump_result",
    "dump_state",
    "event_from_row",
    "kept_or_said",
    "lease_from_row",
    "list_runs_query",
    "load_data",
    "op_from_row",
    "run_from_row",
]

# the head of every statement logging events (``VALUES`` or a ``SELECT`` follows)
EVENT_INTO = "INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)"
APPROVAL_COLUMNS = (
    "id, run_id, scope, approver, status, expires_at, requested_by, decided_by, created_at,"
    " decided_at"
)
RUN_COLUMNS = (
    "id, name, owner, tenant, parent_id, state, fence, grants, phase, policy, "
    "created_at, updated_at, cancelled_by, cancel_reason, cancelled_at"
)
OP_COLUMNS = (
    "id, run_id, tool, description, args_digest, status, cancellable, can_verify, "
    "can_compensate, cancel_state, attempts, result, has_result, error, cause, evidence, "
    "created_at, updated_at, compensates, worker"
)


def list_runs_query(
    state: RunState | None, owner: str | None, limit: int, mark: str
) -> tuple[str, tuple[Any, ...]]:
    """The runs listing for both backends; ``mark`` is the driver's placeholder."""
    clauses, params = [], []
    if state is not None:
        clauses.append(f"state = {mark}")
        params.append(state.value)
    if owner is not None:
        clauses.append(f"owner = {mark}")
        params.append(owner)
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    sql = f"SELECT {RUN_COLUMNS} FROM runs {where} ORDER BY created_at DESC LIMIT {mark}"
    return sql, (*params, limit)


# json's errors are ValueErrors; RecursionError: a value nested past what this stack
# reads (one written before ``jsontext.MAX_DEPTH`` bounded what is written)
_UNREADABLE = (ValueError, TypeError, KeyError, IndexError, RecursionError)


def _unreadable(what: str, row: Sequence[Any], exc: Exception) -> LedgerCorrupt:
    """A stored row stopline cannot read (a state no release writes, data that is not
    JSON): ``LedgerCorrupt`` naming it, not a bare ``ValueError`` from deep in a read."""
    where = f"row of {what} {row[0]!r}" if row else f"row of {what}"
    return LedgerCorrupt(where, f"cannot be read: {describe(exc)}")


def run_from_row(row: Sequence[Any]) -> RunRecord:
    try:
        return RunRecord(
            id=row[0],
            name=row[1],
            owner=row[2],
            tenant=row[3],
            parent_id=row[4],
            state=RunState(row[5]),
            fence=row[6],
            grants=Grant(row[7]),
            phase=PhaseKind(row[8]) if row[8] else None,
            policy=Policy(row[9]),
            created_at=row[10],
            updated_at=row[11],
            cancelled_by=row[12],
            cancel_reason=row[13],
            cancelled_at=row[14],
        )
    except _UNREADABLE as exc:  # a row another program wrote
        raise _unreadable("run", row, exc) from exc


_op_status = by_value(OpStatus)
_cancellable = by_value(Cancellable)
_cancel_state = CancelState.parse


def op_from_row(row: Sequence[Any]) -> OperationRecord:
    try:
        return OperationRecord(
            id=row[0],
            run_id=row[1],
            tool=row[2],
            description=row[3],
            args_digest=row[4],
            status=_op_status(row[5]),
            cancellable=_cancellable(row[6]),
            can_verify=bool(row[7]),
            can_compensate=bool(row[8]),
            cancel_state=_cancel_state(row[9]),
            attempts=row[10],
            result=json.loads(row[11]) if row[12] else None,
            has_result=bool(row[12]),
            error=row[13],
            cause=Cause(row[14]) if row[14] else None,
            evidence=LazyEvidence(row[15]),
            created_at=row[16],
            updated_at=row[17],
            compensates=row[18],
            worker=row[19],
        )
    except _UNREADABLE as exc:  # a row another program wrote
        raise _unreadable("operation", row, exc) from exc


def approval_from_row(row: Sequence[Any]) -> ApprovalRecord:
    try:
        return ApprovalRecord(
            id=row[0],
            run_id=row[1],
            scope=row[2],
            approver=row[3],
            status=ApprovalStatus(row[4]),
            expires_at=row[5],
            requested_by=row[6],
            decided_by=row[7],
            created_at=row[8],
            decided_at=row[9],
        )
    except _UNREADABLE as exc:  # a row another program wrote
        raise _unreadable("approval", row, exc) from exc


def event_from_row(row: Sequence[Any]) -> EventRecord:
    try:
        return EventRecord(
            seq=row[0],
            at=row[1],
            run_id=row[2],
            op_id=row[3],
            kind=row[4],
            from_state=row[5],
            to_state=row[6],
            data=_object(json.loads(row[7])),
        )
    except _UNREADABLE as exc:  # a row another program wrote
        raise _unreadable("event", row, exc) from exc


def _object(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise TypeError(f"an event's data is a JSON object, not {type(data).__name__}")
    return data


def dump_evidence(evidence: Sequence[Evidence]) -> str:
    return jsontext.compact([e.to_json() for e in evidence])


def dump_result(result: Any, has_result: bool) -> tuple[str | None, bool]:
    """JSON text of a result, or (None, False) when it is absent, not JSON-able, nested
    deeper than ``jsontext.MAX_DEPTH`` or longer than the ledger keeps
    (``MAX_RESULT_CHARS``: the outcome is written without it; ``kept_or_said`` says so)."""
    if not has_result:
        return None, False
    try:
        text = jsontext.compact(result)
    except (TypeError, ValueError, RecursionError):  # nested too deeply: not kept either
        return None, False
    return (text, True) if len(text) <= MAX_RESULT_CHARS else (None, False)


def kept_or_said(
    result: Any, has_result: bool, evidence: Sequence[Evidence]
) -> tuple[str | None, bool, Sequence[Evidence]]:
    """``dump_result``, and the evidence to write with it: a result given to be kept that
    the ledger cannot keep (a read-back's set, a value too long or too deep) is written
    with ``result_not_replayable`` evidence saying why, as an answer's is
    (``committed_evidence``), so a replay raises ``NotReplayable`` on every backend. It
    was dropped without a word: the operation committed with no result and a replay
    returned ``None``, a value the provider never gave (R10)."""
    text, kept = dump_result(result, has_result)
    if kept or not has_result or any(e.ref == NOT_REPLAYABLE for e in evidence):
        return text, kept, evidence
    why = result_digest(result)[1] or (
        f"the result ({type(result).__name__}) cannot be written out: a replay cannot return it"
    )
    return None, False, [*evidence, Evidence.local(NOT_REPLAYABLE, why)]


def dump_state(state: Any) -> str:
    """A checkpoint's state as JSON text, else ``InvalidInput`` naming it, before anything
    is written: the JSON a result is kept as (``dump_result``), on every backend. A set
    or ``bytes`` raised a bare ``TypeError`` from inside the checkpoint's transaction,
    one nested too deeply a ``RecursionError``; a state of a gigabyte was written."""
    try:
        text = jsontext.compact(state)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidInput("state", f"cannot be written as JSON ({describe(exc)})") from None
    if len(text) > MAX_RESULT_CHARS:
        raise InvalidInput(
            "state", f"{len(text):,} characters of JSON; at most {MAX_RESULT_CHARS:,}"
        )
    return text


def dump_data(data: Mapping[str, Any]) -> str:
    return jsontext.compact_or_str(data)


def load_data(text: str) -> dict[str, Any]:
    """An event's ``data`` column."""
    data: dict[str, Any] = json.loads(text)
    return data


def lease_from_row(row: Sequence[Any]) -> WorkerLease:
    """``(worker, last activity, in flight, host, pid, lease_until)``."""
    return WorkerLease(row[0], row[3], row[4], row[5], last_activity=row[1], in_flight=row[2])
