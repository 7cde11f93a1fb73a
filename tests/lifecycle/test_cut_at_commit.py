"""ADR 0043: on SQLite under asyncio, a cancel's cut is made as its fence commits, in
the writer's wake of the loop, before the canceller's task resumes; what was cut is
followed (recorded, providers asked) whatever the canceller meets after."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import cast

import pytest

import stopline
from stopline.domain.lifecycle import CancelResult
from stopline.domain.model import RunRecord
from stopline.domain.vocab import Cause, OpStatus
from stopline.ledger.forwarding import ForwardingBackend
from stopline.runtime.lifecycle import Lifecycle, _Cut, _EarlyCut
from stopline.runtime.outcomes import INTERRUPTED
from tests.support.held import Held

pytestmark = pytest.mark.uvloop_too  # a loop we did not write (conftest)


async def test_the_call_sees_its_cancel_before_the_canceller_resumes(tmp_path: Path) -> None:
    """When the backend's cancel returns (to an observer), the call has seen its cancel
    already. Before, the canceller resumed first and cut the call a loop turn later."""
    seen_on_return: list[bool] = []

    class Returns(ForwardingBackend):
        async def cancel(self, run_id: str, *, by: str, reason: str = "") -> CancelResult:
            result = await self.inner.cancel(run_id, by=by, reason=reason)
            seen_on_return.append(held.interrupted.is_set())
            return result

    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}", observers=[Returns]) as ledger:
        held = Held(ledger)
        async with held.in_flight():
            await ledger.cancel(held.ids[0], by="u")
    assert seen_on_return == [True]


async def test_what_was_cut_is_recorded_though_the_cancel_then_fails(tmp_path: Path) -> None:
    """An observer failing after the fence committed: the call was cut as it committed,
    so its record (unknown, R3) still follows, and the caller gets the failure."""

    class Fails(ForwardingBackend):
        async def cancel(self, run_id: str, *, by: str, reason: str = "") -> CancelResult:
            await self.inner.cancel(run_id, by=by, reason=reason)
            raise RuntimeError("observer broke")

    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}", observers=[Fails]) as ledger:
        held = Held(ledger)
        async with held.in_flight():
            with pytest.raises(RuntimeError, match="observer broke"):
                await ledger.cancel(held.ids[0], by="u")
        receipt = await ledger.wait_settled(held.ids[0], timeout=30)
    (line,) = receipt.lines
    assert line.status is OpStatus.NEEDS_REVIEW  # unknown (R3), and no read-back
    assert (Cause.USER_CANCEL.value, INTERRUPTED) in [(e.ref, e.detail) for e in line.evidence]


async def test_an_error_cutting_at_commit_reaches_the_canceller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Lifecycle._cut
    calls: list[int] = []

    def breaks_once(self: Lifecycle, run_ids: list[str]) -> _Cut:
        calls.append(1)
        if len(calls) == 1:
            raise LookupError("cut broke")
        return real(self, run_ids)

    monkeypatch.setattr(Lifecycle, "_cut", breaks_once)
    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}") as ledger:
        held = Held(ledger)
        async with held.in_flight():
            with pytest.raises(LookupError, match="cut broke"):
                await ledger.cancel(held.ids[0], by="u")
            await ledger.cancel(held.ids[0], by="u")  # again: idempotent, and cut
    assert held.interrupted.is_set()


def test_a_cut_at_commit_is_not_made_once_its_canceller_went_on() -> None:
    """Past the canceller's wait (a cancelled caller that gave up on its job), the
    commit's hook cuts nothing: the cancel is delivered as any other is."""
    taken: list[Sequence[str]] = []

    def take(run_ids: Sequence[str]) -> _Cut:
        taken.append(run_ids)
        raise AssertionError("cut after its canceller went on")

    early = _EarlyCut(take, follow=lambda cut: None)
    early.open = False
    early(CancelResult(run=cast(RunRecord, None), first=True, fenced=("r",), released=()))
    assert taken == [] and early.cut is None and early.error is None


def test_a_cut_at_commit_is_made_once() -> None:
    """A second commit through the same hook (an observer retrying the inner cancel)
    cuts nothing: the first cut, not yet followed, is kept for its canceller."""
    taken: list[Sequence[str]] = []

    def take(run_ids: Sequence[str]) -> _Cut:
        taken.append(run_ids)
        return _Cut(run_ids, {}, {}, set(), [])

    early = _EarlyCut(take, follow=lambda cut: None)
    result = CancelResult(run=cast(RunRecord, None), first=True, fenced=("r",), released=())
    early(result)
    first = early.cut
    early(result)
    assert taken == [("r",)] and early.cut is first
