"""stopline: a cancellation contract for AI agents.

async with stopline.open("sqlite:///agent.db") as ledger:
    async with ledger.run("refund", owner="user:42") as run:
        await run.call(issue_refund, order, amount)
    receipt = await ledger.cancel(run.id, by="user:42")
"""

from stopline.domain.lifecycle import (
    AccessPolicy,
    Action,
    ApprovalRecord,
    ApprovalStatus,
    Checkpoint,
    OwnerOrTenantAdmin,
    Principal,
    operator,
)
from stopline.domain.model import CancelState, Evidence, OperationRecord, RunRecord
from stopline.domain.receipt import OperationLine, Receipt
from stopline.domain.vocab import (
    Cancellable,
    Cause,
    EvidenceKind,
    Grant,
    Headline,
    OpStatus,
    PhaseKind,
    Policy,
    RunState,
)
from stopline.errors import (
    AlreadyAttached,
    ApprovalNeeded,
    ApprovalRequired,
    CancelInDoubt,
    IdempotencyConflict,
    IllegalTransition,
    InvalidInput,
    LedgerClosed,
    LedgerCorrupt,
    LedgerError,
    LedgerFull,
    LedgerIOError,
    LedgerLocked,
    LedgerReadOnly,
    LedgerRefused,
    LedgerUnavailable,
    NotFound,
    NotPermitted,
    NotReplayable,
    OperationInDoubt,
    RunCancelled,
    RunEnded,
    RunFenced,
    RunPaused,
    SchemaTooNew,
    SchemaTooOld,
    StoplineError,
    UnknownOperation,
    UnknownRun,
    WrongEventLoop,
)
from stopline.runtime.compensate import CompensationContext
from stopline.runtime.context import CallContext
from stopline.runtime.ledger import Ledger, VerifyBudget
from stopline.runtime.lifecycle import Resumed, Retry
from stopline.runtime.opening import open
from stopline.runtime.reconcile import ReconcileSummary
from stopline.runtime.recovery import RecoveryReport
from stopline.runtime.review import ReviewCase, ReviewItem, ReviewVerdict
from stopline.runtime.run import Run
from stopline.runtime.tool import (
    Compensation,
    NoAnswer,
    ReadBack,
    Rejected,
    Tool,
    Verdict,
    Verifier,
    tool,
)

__version__ = "0.1.0"

__all__ = [
    "AccessPolicy",
    "Action",
    "AlreadyAttached",
    "ApprovalNeeded",
    "ApprovalRecord",
    "ApprovalRequired",
    "ApprovalStatus",
    "CallContext",
    "CancelInDoubt",
    "CancelState",
    "Cancellable",
    "Cause",
    "Checkpoint",
    "Compensation",
    "CompensationContext",
    "Evidence",
    "EvidenceKind",
    "Grant",
    "Headline",
    "IdempotencyConflict",
    "IllegalTransition",
    "InvalidInput",
    "Ledger",
    "LedgerClosed",
    "LedgerCorrupt",
    "LedgerError",
    "LedgerFull",
    "LedgerIOError",
    "LedgerLocked",
    "LedgerReadOnly",
    "LedgerRefused",
    "LedgerUnavailable",
    "NoAnswer",
    "NotFound",
    "NotPermitted",
    "NotReplayable",
    "OpStatus",
    "OperationInDoubt",
    "OperationLine",
    "OperationRecord",
    "OwnerOrTenantAdmin",
    "PhaseKind",
    "Policy",
    "Principal",
    "ReadBack",
    "Receipt",
    "ReconcileSummary",
    "RecoveryReport",
    "Rejected",
    "Resumed",
    "Retry",
    "ReviewCase",
    "ReviewItem",
    "ReviewVerdict",
    "Run",
    "RunCancelled",
    "RunEnded",
    "RunFenced",
    "RunPaused",
    "RunRecord",
    "RunState",
    "SchemaTooNew",
    "SchemaTooOld",
    "StoplineError",
    "Tool",
    "UnknownOperation",
    "UnknownRun",
    "Verdict",
    "Verifier",
    "VerifyBudget",
    "WrongEventLoop",
    "__version__",
    "open",
    "operator",
    "tool",
]
