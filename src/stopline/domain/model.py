"""Plain records of runs, operations, evidence and ledger events.

These are values: the ledger returns them, the receipt reads them, nothing
here does I/O. Times are seconds since the epoch (float), as the ledger
stores them.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import hashlib
import json
import math
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

from stopline.domain import jsontext
from stopline.domain.limits import MAX_RESULT_CHARS, check_id, sanitise, storable
from stopline.domain.vocab import (
    Cancellable,
    Cause,
    EvidenceKind,
    Grant,
    OpStatus,
    PhaseKind,
    Policy,
    RunState,
    by_value,
)
from stopline.errors import LedgerCorrupt, UnstableValue, describe

__all__ = [
    "CANCEL_ANSWERS",
    "NOT_REPLAYABLE",
    "SAYS_NOTHING_OF_THE_WORK",
    "CancelState",
    "EventRecord",
    "Evidence",
    "LazyEvidence",
    "OperationRecord",
    "OperationSpec",
    "RunRecord",
    "UnstableValue",
    "args_digest",
    "committed_evidence",
    "digest",
    "horizon_evidence",
    "horizon_in",
    "result_digest",
]


def digest(value: Any) -> str:
    """A stable digest of JSON-able data (``repr`` for the rest), for evidence.

    Raises ``ValueError`` for a value that cannot be written at all (a
    self-referencing structure): the caller records that as its cause.
    """
    text = jsontext.canonical_or_repr(value)
    return _sha(text)


def args_digest(value: Any) -> str:
    """The digest of a call's arguments, equal in every process for equal arguments.

    Sets are sorted, tuples are lists, enums their values, dataclasses their
    fields; an object that has only the default ``repr`` (its memory address)
    or a structure that refers to itself raises ``UnstableValue`` naming where; so do
    arguments it cannot write at all (nested past Python's recursion limit, an integer
    past its digits limit), which raised ``RecursionError`` or ``ValueError`` (ADR 0078).
    """
    try:
        plain = value if _plain(value, 4) else _canonical(value, "args", set())
        return _sha(jsontext.canonical(plain))
    except RecursionError:
        raise UnstableValue("args", "nested too deeply to be digested") from None
    except ValueError as exc:
        if isinstance(exc, UnstableValue):
            raise
        raise UnstableValue("args", f"cannot be written as text: {exc}") from None


_SCALARS = frozenset({str, int, bool, type(None)})


def _plain(value: Any, depth: int) -> bool:
    """Already its own canonical form: JSON scalars (exact types, finite floats) in
    lists, tuples and dicts with ``str`` keys, a few levels deep (the usual call)."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is float:
        return math.isfinite(value)
    if depth == 0:
        return False
    if kind is list or kind is tuple:
        return all(_plain(v, depth - 1) for v in value)
    if kind is dict:
        return all(type(k) is str and _plain(v, depth - 1) for k, v in value.items())
    return False


def result_digest(value: Any) -> tuple[str, str | None]:
    """``digest(value)``, and why a replay cannot return the value (``None``: it can;
    the ledger keeps it): it is not JSON, or its JSON is longer than the ledger keeps.

    Never raises: an answer came, and it proves its call happened whatever it holds.
    One that cannot be written out at all (nested past Python's recursion limit, an
    integer past its digits limit) is digested by its type alone, said so."""
    kind = type(value).__name__
    try:
        text = jsontext.canonical(value)
    except TypeError:  # not JSON: digested through repr, not replayable
        try:
            return digest(value), f"a {kind} is not JSON: a replay cannot return it"
        except Exception as exc:  # its repr fails too (or is past the limits)
            return _unwritable(kind, exc)
    except (RecursionError, ValueError) as exc:
        return _unwritable(kind, exc)
    if len(text) > MAX_RESULT_CHARS:
        return _sha(text), (
            f"the result is {len(text):,} characters of JSON and the ledger keeps at most"
            f" {MAX_RESULT_CHARS:,}: a replay cannot return it"
        )
    return _sha(text), None


def _unwritable(kind: str, exc: BaseException) -> tuple[str, str]:
    why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
    return _sha(f"unwritable {kind}"), (
        f"the result ({kind}) cannot be written out ({why}): a replay cannot return it,"
        " and its digest names its type only"
    )


NOT_REPLAYABLE = "result_not_replayable"  # evidence ref: the result was not kept


def committed_evidence(result: Any, detail: str = "") -> tuple[list[Evidence], bool]:
    """The evidence a response proves a commit with, and whether the ledger keeps the
    result to return on a replay (if not, the evidence says why)."""
    response, not_kept = result_digest(result)
    evidence = [Evidence(EvidenceKind.RESPONSE_DIGEST, response, detail)]
    if not_kept:  # refused now, at record time, rather than a None on replay
        evidence.append(Evidence.local(NOT_REPLAYABLE, not_kept))
    return evidence, not not_kept


def _sha(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _canonical(value: Any, path: str, seen: set[int]) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, enum.Enum):
        return _canonical(value.value, path, seen)
    if isinstance(value, bytes | bytearray):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return {"time": value.isoformat()}
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return {type(value).__name__: str(value)}
    if id(value) in seen:
        raise UnstableValue(path, "the structure refers to itself")
    seen = seen | {id(value)}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _canonical(v, f"{path}[{k!r}]", seen) for k, v in value.items()}
        # a key that is not text keeps its type: {1: x} is not {"1": x}, and
        # {1: x, "1": y} keeps both (ADR 0110)
        pairs = [
            [_canonical(k, path, seen), _canonical(v, f"{path}[{k!r}]", seen)]
            for k, v in value.items()
        ]
        return {"dict": sorted(pairs, key=lambda kv: json.dumps(kv, sort_keys=True))}
    if isinstance(value, list | tuple):
        return [_canonical(v, f"{path}[{i}]", seen) for i, v in enumerate(value)]
    if isinstance(value, set | frozenset):
        items = [_canonical(v, f"{path}{{...}}", seen) for v in value]
        return {"set": sorted(items, key=lambda i: json.dumps(i, sort_keys=True))}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {type(value).__qualname__: _canonical(fields, path, seen)}
    dump = getattr(value, "model_dump", None)  # pydantic models
    if callable(dump):
        return {type(value).__qualname__: _canonical(dump(mode="json"), path, seen)}
    if type(value).__repr__ is object.__repr__:  # type: ignore[comparison-overlap]
        raise UnstableValue(
            path,
            f"a {type(value).__qualname__} has no stable form (its repr is its memory "
            "address); pass JSON-able arguments or name the operation with key=...",
        )
    return {type(value).__qualname__: repr(value)}


_evidence_kind = by_value(EvidenceKind)


@dataclasses.dataclass(frozen=True, slots=True)
class Evidence:
    """A pointer to what a status rests on."""

    kind: EvidenceKind
    ref: str
    detail: str = ""

    def __post_init__(self) -> None:  # whoever wrote it: text every backend can store
        if not (storable(self.ref) and storable(self.detail)):
            object.__setattr__(self, "ref", sanitise(self.ref))
            object.__setattr__(self, "detail", sanitise(self.detail))

    def to_json(self) -> dict[str, str]:
        out = {"kind": self.kind.value, "ref": self.ref}
        if self.detail:
            out["detail"] = self.detail
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, str]) -> Evidence:
        return cls(_evidence_kind(data["kind"]), data["ref"], data.get("detail", ""))

    @classmethod
    def local(cls, ref: str, detail: str = "") -> Evidence:
        return cls(EvidenceKind.LOCAL, ref, detail)


def horizon_evidence(at: float) -> Evidence:
    """R13: the evidence that records an operation's horizon (epoch seconds)."""
    return Evidence.local("horizon", f"{at:.3f}")


def horizon_in(evidence: Iterable[Evidence]) -> float | None:
    """The horizon the first ``horizon`` item of ``evidence`` records, if any."""
    for e in evidence:
        if e.kind is EvidenceKind.LOCAL and e.ref == "horizon":
            try:
                return float(e.detail)
            except ValueError:
                return None
    return None


class LazyEvidence(Sequence[Evidence]):
    """An operation's evidence, decoded from its stored JSON on first use; immutable.

    The gate's hot path returns records nobody reads the evidence of, and a
    receipt's line keeps it as it is: a page of receipts, or ``wait_settled``
    asking whether a run is settled, reads the statuses only. Decoding it there
    would cost the writer thread, or the loop, for nothing.
    """

    __slots__ = ("_items", "_raw")

    def __init__(self, raw: str) -> None:
        self._raw = raw
        self._items: tuple[Evidence, ...] | None = None

    def _decoded(self) -> tuple[Evidence, ...]:
        if self._items is None:
            try:
                self._items = tuple(Evidence.from_json(e) for e in json.loads(self._raw))
            except (ValueError, TypeError, KeyError) as exc:  # written by another program
                raise LedgerCorrupt("row of evidence", f"cannot be read: {describe(exc)}") from exc
        return self._items

    @overload
    def __getitem__(self, index: int) -> Evidence: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Evidence]: ...
    def __getitem__(self, index: int | slice) -> Evidence | Sequence[Evidence]:
        return self._decoded()[index]

    def __len__(self) -> int:
        return len(self._decoded())

    # the tuple's own iterators: ``Sequence``'s index each item and end on an IndexError
    # (a receipt copies every record's evidence into its line)
    def __iter__(self) -> Iterator[Evidence]:
        return iter(self._decoded())

    def __reversed__(self) -> Iterator[Evidence]:
        return reversed(self._decoded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return self._decoded() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._decoded())

    def __repr__(self) -> str:
        return repr(self._decoded())


class CancelState(enum.StrEnum):
    """What was asked of the provider about cancelling one operation, and what it said
    (R14: worded as observed)."""

    NOT_ASKED = "not_asked"  # no cancel request was sent
    ASKED = "asked"  # sent; no answer yet
    CONFIRMED = "confirmed"  # the provider confirmed the request ended without effect
    REFUSED = "refused"  # the provider answered that it will not cancel
    UNANSWERED = "unanswered"  # sent; no answer came within the wait
    NOT_SUPPORTED = "not_supported"  # the call's interface offers no way to ask
    ERROR = "error"  # the provider answered with an error: no word on the work (ADR 0083)
    # the provider took the request and said no more (an MCP tasks/cancel answered):
    # no word on the work either (ADR 0083, amendment)
    ACKNOWLEDGED = "acknowledged"

    NONE = "none"  # stored by earlier versions for NOT_ASKED; read back as NOT_ASKED

    @classmethod
    def parse(cls, stored: str) -> CancelState:
        """The member a stored value reads back as (one dict lookup: a receipt asks each
        of its lines); a value no member has raises ``ValueError``."""
        return _cancel_state(stored)


def _read_back(stored: str) -> CancelState:
    state = CancelState(stored)
    return CancelState.NOT_ASKED if state is CancelState.NONE else state


_cancel_state = by_value(CancelState, _read_back)

# what a provider said of a cancel, recorded as its answer (not asked, asked, no answer:
# they tell nothing a cut's own record does not)
CANCEL_ANSWERS = frozenset(
    {CancelState.CONFIRMED, CancelState.REFUSED, CancelState.ERROR, CancelState.ACKNOWLEDGED}
)
# answers that say nothing of the work: nothing more to wait for from the provider, and
# the work is still read (ADR 0083)
SAYS_NOTHING_OF_THE_WORK = frozenset({CancelState.ERROR, CancelState.ACKNOWLEDGED})


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

    def __post_init__(self) -> None:  # refused or made storable before the gate writes it
        check_id("tool", self.tool)
        if not storable(self.description):
            object.__setattr__(self, "description", sanitise(self.description))


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
    cancel_state: CancelState
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
    def result_not_kept(self) -> str | None:
        """Why the ledger holds no result of this commit to return (``committed_evidence``
        said so when it was recorded), else ``None``."""
        for e in self.evidence:
            if e.kind is EvidenceKind.LOCAL and e.ref == NOT_REPLAYABLE:
                return e.detail
        return None

    @property
    def horizon(self) -> float | None:
        """R13: the latest moment this operation's effect could still land, when one
        was recorded (``horizon`` evidence, written with the lost answer)."""
        return horizon_in(reversed(self.evidence))

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
