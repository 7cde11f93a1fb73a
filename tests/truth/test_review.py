"""The review queue: list, inspect, resolve, with the reviewer recorded (R11)."""

from __future__ import annotations

import anyio
import pytest

import stopline
from stopline import Cancellable, EvidenceKind, Headline, OpStatus, Policy, RunState
from stopline.errors import NotInReview
from stopline.testing import FakeProvider
from tests.scenarios.workflows import calls, start
from tests.truth.helpers import Remote, quiesce


async def in_review(ledger: stopline.Ledger, provider: FakeProvider) -> tuple[str, str]:
    """A cancelled run whose one operation nobody can verify: (run id, op id)."""
    held = provider.hold("committed")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(provider, policy=Policy.IMMEDIATE))
        await held.reached.wait()
        await ledger.cancel(started.run_id, by="user:1")
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.headline is Headline.NEEDS_REVIEW
    assert receipt.run_state is RunState.NEEDS_REVIEW
    return started.run_id, receipt.lines[0].op_id


async def test_review_list_inspect_resolve_committed(ledger: stopline.Ledger) -> None:
    blind = FakeProvider("notify", cancellable=Cancellable.NEVER, verifiable=False)
    run_id, op_id = await in_review(ledger, blind)
    (item,) = await ledger.review_items()
    assert (item.op.id, item.run.id) == (op_id, run_id)
    assert item.to_json()["status"] == "needs_review"
    case = await ledger.inspect_review(op_id)
    kinds = [e.kind for e in case.events]
    assert [k for k in kinds if not k.startswith("cancel_")] == [
        "gate_passed",
        "accepted",
        "lost",
        "escalated",
    ]
    assert "cancel_not_asked" in kinds  # R14: never asked (its provider cannot cancel), recorded
    assert case.to_json()["evidence"][-1]["ref"] == "no_verifier"
    receipt = await ledger.resolve_review(
        op_id, "committed", by="user:1", note="the message is in the channel"
    )
    assert receipt.run_state is RunState.CANCELLED  # the run closes with its last item
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    op = await ledger.backend.get_operation(op_id)
    decision = op.evidence[-1]
    assert decision.kind is EvidenceKind.REVIEW and decision.ref == "user:1"
    assert decision.detail == "committed: the message is in the channel"
    assert await ledger.review_items() == []


async def test_review_resolve_not_committed(ledger: stopline.Ledger) -> None:
    blind = FakeProvider("notify", cancellable=Cancellable.NEVER, verifiable=False)
    _, op_id = await in_review(ledger, blind)
    receipt = await ledger.resolve_review(op_id, "not_committed", by="user:1")
    assert receipt.lines[0].status is OpStatus.NOT_COMMITTED
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert receipt.run_state is RunState.CANCELLED


async def test_review_resolve_compensate(ledger: stopline.Ledger) -> None:
    remote = Remote(verifiable=False)
    remote.let_correct.set()
    provider = FakeProvider("book", cancellable=Cancellable.NEVER, verifiable=False)
    provider.tool.compensate_fn = remote.tool.compensate_fn
    provider.tool.compensation_verify_fn = remote.tool.compensation_verify_fn
    run_id, op_id = await in_review(ledger, provider)
    await ledger.resolve_review(op_id, "compensate", by="user:1", note="it went out; undo it")
    await quiesce(ledger)
    receipt = await ledger.receipt(run_id)
    assert receipt.headline is Headline.CORRECTED
    assert receipt.run_state is RunState.CANCELLED
    assert [line.status for line in receipt.lines] == [OpStatus.COMPENSATED, OpStatus.COMMITTED]


async def test_only_allowed_principals_resolve(ledger: stopline.Ledger) -> None:
    blind = FakeProvider("notify", cancellable=Cancellable.NEVER, verifiable=False)
    run_id, op_id = await in_review(ledger, blind)
    with pytest.raises(stopline.NotPermitted):
        await ledger.resolve_review(op_id, "committed", by="user:mallory")
    assert (await ledger.backend.get_operation(op_id)).status is OpStatus.NEEDS_REVIEW
    denied = [e for e in await ledger.backend.events(run_id) if "denied" in e.kind]
    assert denied  # the refusal is in the audit trail


async def test_bad_verdicts_and_settled_items_are_refused(ledger: stopline.Ledger) -> None:
    blind = FakeProvider("notify", cancellable=Cancellable.NEVER, verifiable=False)
    _, op_id = await in_review(ledger, blind)
    with pytest.raises(ValueError, match="not one of"):
        await ledger.resolve_review(op_id, "maybe", by="user:1")
    await ledger.resolve_review(op_id, "committed", by="user:1")
    before = await ledger.backend.events(op_id.split("/")[0])
    # a decided item is no longer in review: the refusal says so, whatever was asked (a
    # "compensate" was refused for want of a compensator, a "not_committed" for its
    # horizon: what a decision would need, not why there is none to make)
    for verdict in ("not_committed", "committed", "compensate"):
        with pytest.raises(NotInReview, match="is not in review: it is committed") as refused:
            await ledger.resolve_review(op_id, verdict, by="user:1")
        assert isinstance(refused.value, stopline.IllegalTransition)
    assert await ledger.backend.events(op_id.split("/")[0]) == before  # nothing recorded


async def test_a_decision_on_an_operation_never_in_review_is_refused(
    ledger: stopline.Ledger,
) -> None:
    """A call its read-back proved: no reviewer decides it, nothing is recorded."""
    provider = FakeProvider("send")
    async with ledger.run("mail", owner="user:1", run_id="r") as run:
        await run.call(provider.tool, "hi", key="k")
    with pytest.raises(NotInReview, match="'r/k' is not in review: it is committed"):
        await ledger.resolve_review("r/k", "not_committed", by="user:1")
    assert (await ledger.backend.get_operation("r/k")).status is OpStatus.COMMITTED
