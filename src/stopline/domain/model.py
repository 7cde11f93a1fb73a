"""Plain records of runs, operations, evidence and ledger events.

These are values: the ledger returns them, the receipt reads them, nothing
here does I/O. Times are seconds since the epoch (float), as the ledger
stores them.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from stopline.domain.vocab import (
    Cancellable,
    Cause,
    EvidenceKind,
    Grant,
    OpStatus,
    PhaseKind,
    Policy,
    RunState,
)

__all__ = [
    "CancelState",
    "EventRecord",
    "Evidence",
    "OperationRecord",
    "OperationSpec",
    "RunRecord",
    "digest",
]


def digest(value: Any) -> str:
    """A stable digest of JSON-able data (``repr`` for the rest), for evidence and keys."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True, slots=True)
class Evidence:
    """A pointer to what a status rests on."""

    kind: EvidenceKind
    ref: str
    detail: str = ""

    def to_json(self) -> dict[str, str]:
        out = {"kind": self.kind.value, "ref": self.ref}
        if self.detail:
            out["detail"] = self.detail
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, str]) -> Evidence:
        return cls(EvidenceKind(data["kind"]), data["ref"], data.get("detail", ""))

    @classmethod
    def local(cls, ref: str, detail: str = "") -> Evidence:
        return cls(EvidenceKind.LOCAL, ref, detail)


class CancelState(enum.StrEnum):
    """What was asked of the provider about cancelling one operation."""

    NONE = "none"
    ASKED = "asked"
    REFUSED = "refused"
    CONFIRMED = "confirmed"


@dataclasses.dataclass(frozen=True, slots=True)
class RunRecord:
    id: str
    name: str
    owner: str
    tenant: str
    parent_id: str | None
    state: RunState
    fence: int
    grants: Grant
    phase: PhaseKind | None
    policy: Policy
    created_at: float
    updated_at: float
    cancelled_by: str | None = None
    cancel_reason: str | None = None
    cancelled_at: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class OperationSpec:
    """What the gate needs to record an intent."""

    id: str
    run_id: str
    tool: str
    args_digest: str
    description: str
    cancellable: Cancellable
    can_verify: bool
    can_compensate: bool
    compensates: str | None = None  # set for a compensation: the operation it corrects
    worker: str = ""  # the worker (process) that passes the gate
    needs_approval: bool = False  # passes only with a granted, unexpired approval (S5)


@dataclasses.dataclass(frozen=True, slots=True)
class OperationRecord:
    id: str
    run_id: str
    tool: str
    description: str
    args_digest: str
    status: OpStatus
    cancellable: Cancellable
    can_verify: bool
    can_compensate: bool
    cancel_state: str
    attempts: int
    result: Any
    has_result: bool
    error: str | None
    cause: Cause | None
    evidence: Sequence[Evidence]
    created_at: float
    updated_at: float
    compensates: str | None = None
    worker: str = ""

    @property
    def provider_can_cancel(self) -> bool:
        """Whether asking the provider to cancel can still help now."""
        if self.cancel_state in (CancelState.REFUSED, CancelState.CONFIRMED):
            return False
        if self.status is OpStatus.REQUESTED:
            return self.cancellable is not Cancellable.NEVER
        if self.status in (OpStatus.ACCEPTED, OpStatus.UNKNOWN):
            return self.cancellable is Cancellable.AFTER_ACCEPTED
        return False


@dataclasses.dataclass(frozen=True, slots=True)
class EventRecord:
    """One line of the append-only log."""

    seq: int
    at: float
    run_id: str
    op_id: str | None
    kind: str
    from_state: str | None
    to_state: str | None
    data: Mapping[str, Any]
