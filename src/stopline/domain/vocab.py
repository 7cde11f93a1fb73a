"""The contract's vocabulary, defined once.

Every status, event, policy and outcome in CONTRACT.md is an enum member here;
the rest of the package never compares raw strings. Enum values are the
words of the contract, so they read the same in the ledger, in JSON receipts
and in the docs.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "Cancellable",
    "Cause",
    "EvidenceKind",
    "Grant",
    "Headline",
    "LogKind",
    "NoteKind",
    "OpEvent",
    "OpStatus",
    "PhaseKind",
    "Policy",
    "RunEvent",
    "RunState",
    "by_value",
]

E = TypeVar("E", bound=enum.Enum)


def by_value(kind: type[E], parse: Callable[[Any], E] | None = None) -> Callable[[Any], E]:
    """Stored value -> member by one dict lookup (an ``Enum`` call costs ~0.5 µs, and a
    page of receipts reads thousands of rows, each with several); a value no member has
    still raises, as the call would. ``parse`` maps a stored value to its member when
    that is not the member of the value itself (an old spelling)."""
    parse = parse or kind
    members = {member.value: parse(member.value) for member in kind}

    def member(value: Any) -> E:
        found = members.get(value)
        return parse(value) if found is None else found

    return member


class RunState(enum.StrEnum):
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    CANCELLING = "cancelling"
    SETTLING = "settling"
    CANCELLED = "cancelled"
    NEEDS_REVIEW = "needs_review"
    COMPLETED = "completed"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        """Nothing runs in it any more (a cancelled one may still be resumed, R10)."""
        return self in (
            RunState.COMPLETED,
            RunState.FAILED,
            RunState.CANCELLED,
            RunState.NEEDS_REVIEW,
        )

    @property
    def paused(self) -> bool:
        """Its gate lets no call through until a resume (or a cancel) moves it on."""
        return self in (RunState.PAUSING, RunState.PAUSED)

    @property
    def fenced(self) -> bool:
        """Where a cancel leads, short of a resume: its gate lets no call through, and
        its state is the cancel's doing (who cancelled it, and why, is its story)."""
        return self in (
            RunState.CANCELLING,
            RunState.SETTLING,
            RunState.CANCELLED,
            RunState.NEEDS_REVIEW,
        )


class RunEvent(enum.StrEnum):
    PAUSE = "pause"
    PAUSED = "paused"
    RESUME = "resume"
    CANCEL = "cancel"
    SETTLE = "settle"  # in-flight work remains: cancelling -> settling
    SETTLED = "settled"  # every operation resolved
    ESCALATE = "escalate"  # some outcome cannot be determined
    REVIEWED = "reviewed"  # every review item resolved
    COMPLETE = "complete"
    FAIL = "fail"


class OpStatus(enum.StrEnum):
    NOT_STARTED = "not_started"
    PREVENTED = "prevented"
    REQUESTED = "requested"
    ACCEPTED = "accepted"
    COMMITTED = "committed"
    NOT_COMMITTED = "not_committed"
    UNKNOWN = "unknown"
    NEEDS_REVIEW = "needs_review"
    COMPENSATING = "compensating"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"

    @property
    def in_flight(self) -> bool:
        """Passed the gate and has no outcome yet."""
        return self in _IN_FLIGHT

    @property
    def resolved(self) -> bool:
        """An end state of R2 (or never dispatched); ``needs_review`` is one (R2)."""
        return self in _RESOLVED

    @property
    def settled(self) -> bool:
        """Resolved and waiting for nobody: what a checkpoint or a resume needs (R10)."""
        return self in _RESOLVED and self is not OpStatus.NEEDS_REVIEW


_IN_FLIGHT = frozenset({OpStatus.REQUESTED, OpStatus.ACCEPTED})
_RESOLVED = frozenset(
    {
        OpStatus.PREVENTED,
        OpStatus.COMMITTED,
        OpStatus.NOT_COMMITTED,
        OpStatus.COMPENSATED,
        OpStatus.NEEDS_REVIEW,
    }
)


class OpEvent(enum.StrEnum):
    GATE_PASSED = "gate_passed"
    GATE_REFUSED = "gate_refused"
    ACCEPTED = "accepted"  # the provider acknowledged the request
    COMMITTED = "committed"  # a response (on time or late) proves the effect
    REJECTED = "rejected"  # the provider refused or failed before commit
    NOT_SENT = "not_sent"  # passed the gate, abandoned before the first byte left
    LOST = "lost"  # no answer: local abort, timeout, disconnect, crash
    CANCEL_CONFIRMED = "cancel_confirmed"  # the provider confirms nothing happened
    VERIFIED_COMMITTED = "verified_committed"
    VERIFIED_NOT_COMMITTED = "verified_not_committed"
    ESCALATED = "escalated"  # verification budget spent, or no verifier
    CONFLICT = "conflict"  # later evidence contradicts a recorded outcome
    REVIEWED_COMMITTED = "reviewed_committed"
    REVIEWED_NOT_COMMITTED = "reviewed_not_committed"
    # a reviewer finds a corrected action happened: it stays corrected (apart from
    # ``compensated``, so that a correction's link cannot take an item out of review)
    REVIEWED_CORRECTED = "reviewed_corrected"
    COMPENSATION_STARTED = "compensation_started"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"


class LogKind(enum.StrEnum):
    """The ledger's log entries that are not a transition of the tables above."""

    RUN_CREATED = "run_created"
    PHASE = "phase"
    OWNER_ADDED = "owner_added"
    OWNER_RELEASED = "owner_released"
    # a block cut by an enclosing run's cancel that did not end its run: it goes on for
    # the owners holding it by a share (R6, ADR 0065)
    LEFT_TO_OWNERS = "left_to_owners"
    APPROVAL_REQUESTED = "approval_requested"
    APPROVAL_GRANTED = "approval_granted"
    APPROVAL_DENIED = "approval_denied"
    CHECKPOINT = "checkpoint"
    AUDIT = "audit"
    DENIED = "denied"  # an audited action the access policy refused


class NoteKind(enum.StrEnum):
    """The log entries that add to an operation without moving it (``Backend.note``):
    what was asked of its provider, what was seen, what a person asked for. (A repeat
    of a recorded outcome is noted as ``evidence_<OpEvent>``, derived from the event.)
    """

    CANCEL_ASKED = "cancel_asked"  # a cancel request was sent to the provider
    CANCEL_REFUSED = "cancel_refused"  # ... and the provider will not cancel
    CANCEL_UNANSWERED = "cancel_unanswered"  # ... and no answer came within the wait
    CANCEL_NOT_ASKED = "cancel_not_asked"  # the tool's policy: never asked (R12)
    CANCEL_NOT_SUPPORTED = "cancel_not_supported"  # the interface offers no way to ask
    CANCEL_ERROR = "cancel_error"  # ... and the provider answered it with an error
    CANCEL_ACKNOWLEDGED = "cancel_acknowledged"  # ... took it, saying nothing of the work
    LATE_RESPONSE = "late_response"  # an answer after the fact that proves nothing (R4)
    VERIFY_FAILED = "verify_failed"  # a read-back raised
    VERIFY_UNKNOWN = "verify_unknown"  # a read-back that could not tell, and why
    READ_BEFORE_RETRY = "read_before_retry"  # a read-back's verdict of an earlier attempt
    PROGRESS = "progress"  # advisory: never proves a commit
    HORIZON_STATED = "horizon_stated"  # the provider's bound (R13), kept across a crash
    COMPENSATION_PROPOSED = "compensation_proposed"  # compensation=ask, on cancel
    COMPENSATION_STOP_ASKED = "compensation_stop_asked"
    MCP_REISSUED = "mcp_reissued"  # a broken stream lost the request: sent again
    TASK_CANCEL_REQUESTED = "task_cancel_requested"  # tasks/cancel sent (MCP tasks)
    # a later run's call repeating it was answered from its record (LangGraph, ADR 0120)
    REPEAT_ANSWERED = "repeat_answered"


class Policy(enum.StrEnum):
    """What a cancel does to work in flight in a phase."""

    IMMEDIATE = "immediate"  # interrupt at once (read-only work)
    AT_BOUNDARY = "at_boundary"  # the current step finishes, then the run stops
    VERIFY = "verify"  # the run cannot stop before proving what happened


class PhaseKind(enum.StrEnum):
    THINKING = "thinking"
    READING = "reading"
    AWAITING_APPROVAL = "awaiting_approval"
    CALLING_EXTERNAL = "calling_external"
    COMMITTING = "committing"
    WAITING_CALLBACK = "waiting_callback"
    HANDOFF = "handoff"
    FINALIZING = "finalizing"

    @property
    def default_policy(self) -> Policy:
        return _DEFAULT_POLICY[self]


_DEFAULT_POLICY = {
    PhaseKind.THINKING: Policy.IMMEDIATE,
    PhaseKind.READING: Policy.IMMEDIATE,
    PhaseKind.AWAITING_APPROVAL: Policy.IMMEDIATE,
    PhaseKind.CALLING_EXTERNAL: Policy.VERIFY,
    PhaseKind.COMMITTING: Policy.VERIFY,
    PhaseKind.WAITING_CALLBACK: Policy.AT_BOUNDARY,
    PhaseKind.HANDOFF: Policy.AT_BOUNDARY,
    PhaseKind.FINALIZING: Policy.AT_BOUNDARY,
}


class Cancellable(enum.StrEnum):
    """Up to which point the provider can still cancel an operation."""

    UNTIL_ACCEPTED = "until_accepted"  # cancel before acceptance only
    AFTER_ACCEPTED = "after_accepted"  # cancel even once accepted
    NEVER = "never"


class Grant(enum.IntFlag):
    """A run's authority. Cancel revokes INITIATE and keeps the rest."""

    INITIATE = 1
    VERIFY = 2
    COMPENSATE = 4
    AUDIT = 8

    @classmethod
    def all(cls) -> Grant:
        return cls.INITIATE | cls.VERIFY | cls.COMPENSATE | cls.AUDIT


class Cause(enum.StrEnum):
    """Why an operation lost its answer or a run stopped: the reason is data."""

    USER_CANCEL = "user_cancel"
    TIMEOUT = "timeout"
    TRANSPORT = "transport"
    SERVER_ERROR = "server_error"
    CRASH = "crash"
    LOCAL_ERROR = "local_error"


class EvidenceKind(enum.StrEnum):
    TRACE = "trace"
    SPAN = "span"
    PROVIDER_RECEIPT = "provider_receipt"
    RESPONSE_DIGEST = "response_digest"
    READ_BACK = "read_back"
    APPROVAL = "approval"
    REVIEW = "review"
    LOCAL = "local"  # what this process itself observed (gate, abort, error)
    PROGRESS = "progress"


class Headline(enum.StrEnum):
    """R8 outcomes, worst first, then the states of a run that was not cancelled."""

    NEEDS_REVIEW = "needs_review"
    VERIFYING = "verifying"
    AWAITING_CONFIRMATION = "awaiting_confirmation"
    CORRECTION_QUEUED = "correction_queued"
    STOPPED_WITH_COMPLETED_ACTIONS = "stopped_with_completed_actions"
    CORRECTED = "corrected"
    CANCELED_BEFORE_EXTERNAL_ACTION = "canceled_before_external_action"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
