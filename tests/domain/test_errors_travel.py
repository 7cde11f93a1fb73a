"""Every error stopline raises crosses a process boundary whole.

DBOS keeps a workflow's exception pickled, Temporal and process pools carry one to
another process. ``BaseException`` pickles its message and rebuilds the class
from it: ``InvalidInput`` and ``OperationInDoubt`` could not be rebuilt at all
(DBOS gave back a ``TypeError``), the others came back with their message wrapped
twice and their fields lost. Here each is raised in a real child process and
caught in this one.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import pickle
from typing import Any

import pytest

from stopline import errors
from stopline.domain.vocab import Cause, OpEvent, OpStatus, RunState

pytestmark = pytest.mark.timeout(60)

SAMPLES: dict[str, BaseException] = {
    "StoplineError": errors.StoplineError("plain"),
    "IllegalTransition": errors.IllegalTransition(OpStatus.UNKNOWN, OpEvent.GATE_PASSED),
    "NotCorrectable": errors.NotCorrectable(
        "run-1/k", OpStatus.COMPENSATED, OpEvent.COMPENSATION_STARTED, "it was corrected already"
    ),
    "NotFound": errors.NotFound("nothing"),
    "UnknownRun": errors.UnknownRun("run-1"),
    "UnknownOperation": errors.UnknownOperation("run-1/k"),
    "UnknownTool": errors.UnknownTool("pay", "billing"),
    "InvalidInput": errors.InvalidInput("key", "contains a NUL character"),
    "UnstableValue": errors.UnstableValue("args[0]", "a set of objects"),
    "IdempotencyConflict": errors.IdempotencyConflict("run-1/k"),
    "AlreadyAttached": errors.AlreadyAttached("run-1"),
    "OperationInDoubt": errors.OperationInDoubt("run-1/k", OpStatus.UNKNOWN),
    "NotReplayable": errors.NotReplayable("run-1/k", why="a Payment is not JSON"),
    "NotPermitted": errors.NotPermitted("user:2 may not cancel run-1"),
    "ApprovalNeeded": errors.ApprovalNeeded("run-1/k", "no approval"),
    "Rejected": errors.Rejected("card declined", ref="ch_1"),
    "NoAnswer": errors.NoAnswer(Cause.TIMEOUT, "no answer within 5s"),
    "NoRun": errors.NoRun("outside a run"),
    "PlanError": errors.PlanError("no cells"),
    "RunEnded": errors.RunEnded("run-1", RunState.COMPLETED),
    "RunPaused": errors.RunPaused("run-1"),
    "LedgerError": errors.LedgerError("sqlite:///l.db", "broken"),
    "LedgerCorrupt": errors.LedgerCorrupt("sqlite:///l.db", "not a database"),
    "LedgerRefused": errors.LedgerRefused("sqlite:///l.db", "CHECK constraint failed"),
    "LedgerLocked": errors.LedgerLocked("sqlite:///l.db", "locked"),
    "RowHeld": errors.RowHeld("postgresql://h/db", "lock timeout", doubt=True),
    "NotInReview": errors.NotInReview("run-1/k", OpStatus.COMMITTED, OpEvent.REVIEWED_COMMITTED),
    "LedgerUnavailable": errors.LedgerUnavailable("sqlite:///l.db", "gone"),
    "LedgerFull": errors.LedgerFull("sqlite:///l.db", "disk full"),
    "LedgerReadOnly": errors.LedgerReadOnly("sqlite:///l.db", "read-only"),
    "LedgerIOError": errors.LedgerIOError("sqlite:///l.db", "I/O error"),
    "CancelInDoubt": errors.CancelInDoubt("postgresql://h/db", "run-1", "reply lost"),
    "SchemaTooOld": errors.SchemaTooOld("sqlite:///l.db", 3, 5, 9),
    "SchemaTooNew": errors.SchemaTooNew("sqlite:///l.db", 12, 9),
    "LeaseExpired": errors.LeaseExpired("worker-1"),
    "CommitInDoubt": errors.CommitInDoubt("postgresql://h/db", "reply lost"),
    "GateInDoubt": errors.GateInDoubt("postgresql://h/db", "run-1/k"),
    "RunFenced": errors.RunFenced("run-1", "run-1/k"),
    "LedgerClosed": errors.LedgerClosed("sqlite:///l.db", "is closed"),
    "WrongEventLoop": errors.WrongEventLoop("sqlite:///l.db", "enter a run"),
}


def _raise(name: str) -> None:
    raise SAMPLES[name]


def _fields(error: BaseException) -> dict[str, Any]:
    return {k: v for k, v in vars(error).items() if k != "_made_with"}


def test_every_public_error_has_a_sample() -> None:
    public = {
        name
        for name in errors.__all__
        if isinstance(getattr(errors, name), type)
        and issubclass(getattr(errors, name), BaseException)
        and getattr(errors, name).__name__ == name  # not a deprecated alias
    }
    assert public == set(SAMPLES)


def test_every_error_raised_in_another_process_arrives_whole() -> None:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        for name, sample in SAMPLES.items():
            with pytest.raises(type(sample)) as caught:
                pool.submit(_raise, name).result()
            arrived = caught.value
            assert type(arrived) is type(sample), name
            assert str(arrived) == str(sample), name
            assert _fields(arrived) == _fields(sample), name


@pytest.mark.parametrize("name", list(SAMPLES))
def test_a_pickled_error_is_the_error_it_was(name: str) -> None:
    sample = SAMPLES[name]
    back = pickle.loads(pickle.dumps(sample))
    assert (type(back), str(back), back.args) == (type(sample), str(sample), sample.args)
