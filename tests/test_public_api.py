"""The public surface is exactly what we mean to export."""

from __future__ import annotations

import stopline
import stopline.testing

EXPECTED = {
    "CancelState",
    "InvalidInput",
    "NotReplayable",
    "RunEnded",
    "AccessPolicy",
    "AlreadyAttached",
    "Action",
    "ApprovalRecord",
    "ApprovalNeeded",
    "ApprovalRequired",  # deprecated alias of ApprovalNeeded (0.2)
    "ApprovalStatus",
    "CallContext",
    "CancelInDoubt",
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
    "RunCancelled",  # deprecated alias of RunFenced (0.2)
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
    "Verifier",  # the one verifier signature: async (ctx: CallContext) -> ReadBack | Verdict
    "VerifyBudget",
    "WrongEventLoop",
    "__version__",
    "open",
    "operator",
    "tool",
}


def test_exported_names_are_exactly_the_intended_ones() -> None:
    assert set(stopline.__all__) == EXPECTED
    for name in stopline.__all__:
        assert hasattr(stopline, name), name


def test_errors_have_one_root_and_cancellation_unwinds() -> None:
    for name in stopline.__all__:
        obj = getattr(stopline, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, stopline.StoplineError), name
    assert issubclass(stopline.RunFenced, BaseException)
    assert not issubclass(stopline.RunFenced, Exception)  # `except Exception` won't eat it


def test_testing_surface() -> None:
    assert set(stopline.testing.__all__) == {
        "CORE_ACTIONS",
        "DEFAULT_ACTIONS",
        "Barrier",
        "Barriers",
        "CancelBehaviour",
        "Cell",
        "CellStatus",
        "ExplorationFailed",
        "FakeProvider",
        "Matrix",
        "explore",
    }


def test_deprecated_names_are_the_new_classes() -> None:
    """Kept for one release (0.2): code catching the old names still catches the new."""
    assert stopline.RunCancelled is stopline.RunFenced
    assert stopline.ApprovalRequired is stopline.ApprovalNeeded
