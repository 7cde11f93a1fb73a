"""stopline: a cancellation contract for AI agents.

async with stopline.open("sqlite:///agent.db") as ledger:
    async with ledger.run("refund", owner="user:42") as run:
        await run.call(issue_refund, order, amount)
    receipt = await ledger.cancel(run.id, by="user:42")
"""

import importlib.abc as _abc
import importlib.machinery as _machinery
import importlib.util as _util
import sys as _sys
from collections.abc import Sequence as _Sequence
from types import ModuleType as _ModuleType

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

# Which extra (pyproject.toml) provides each optional module stopline imports: the
# one table (ADR 0016). A command whose module is missing names the extra from it,
# and so does importing one of the modules below without it (ADR 0081).
EXTRA_OF_MODULE: dict[str, str] = {
    "jinja2": "console",
    "starlette": "console",
    "uvicorn": "console",
    "python_multipart": "console",
    "psycopg": "postgres",
    "psycopg_pool": "postgres",
    "langgraph": "langgraph",
    "langchain_core": "langgraph",
    "pydantic_ai": "pydantic-ai",
    "fastmcp": "pydantic-ai",  # pydantic-ai-slim's MCP toolsets need its client
    "agents": "openai-agents",
    "temporalio": "temporal",
    "dbos": "dbos",
}
# stopline's modules that need an extra, with the optional modules each imports
_NEEDS: dict[str, tuple[str, ...]] = {
    "stopline.console": ("jinja2", "starlette", "uvicorn", "python_multipart"),
    "stopline.integrations.temporal": ("temporalio",),
    "stopline.integrations.dbos": ("dbos",),
    "stopline.integrations.langgraph": ("langgraph", "langchain_core"),
    "stopline.integrations.openai_agents": ("agents",),
    "stopline.integrations.pydantic_ai": ("pydantic_ai", "fastmcp"),
}


def _importable(module: str) -> bool:
    if module in _sys.modules:
        return _sys.modules[module] is not None
    return _util.find_spec(module) is not None


class _ExtraFinder(_abc.MetaPathFinder):
    """Finds nothing itself: before one of ``_NEEDS`` loads, it checks the modules it
    needs and raises ``ModuleNotFoundError`` naming the extra of the first missing."""

    def find_spec(
        self, fullname: str, path: _Sequence[str] | None, target: _ModuleType | None = None
    ) -> _machinery.ModuleSpec | None:
        for module in _NEEDS.get(fullname, ()):
            if not _importable(module):
                extra = EXTRA_OF_MODULE[module]
                raise ModuleNotFoundError(
                    f"{fullname} needs the '{extra}' extra (module {module!r} is not "
                    f"installed): pip install 'stopline[{extra}]'",
                    name=module,
                )
        return None


if not any(type(finder).__name__ == "_ExtraFinder" for finder in _sys.meta_path):
    _sys.meta_path.insert(0, _ExtraFinder())
