"""R8: the headline never claims more than the evidence, worst outcome first."""

from __future__ import annotations

import dataclasses
import json

import pytest

from stopline.domain.model import CancelState, Evidence, OperationRecord, RunRecord
from stopline.domain.receipt import HEADLINE_MESSAGES, build_receipt, headline_for, horizon_words
from stopline.domain.vocab import (
    Cancellable,
    EvidenceKind,
    Grant,
    Headline,
    OpStatus,
    Policy,
    RunState,
)


def run_record(state: RunState = RunState.CANCELLED) -> RunRecord:
    return RunRecord(
        id="run_x",
        name="t",
        owner="u",
        tenant="t",
        parent_id=None,
        state=state,
        fence=1,
        grants=Grant.VERIFY,
        phase=None,
        policy=Policy.VERIFY,
        created_at=0.0,
        updated_at=0.0,
        cancelled_by="u",
        cancel_reason="r",
    )


def op(
    status: OpStatus,
    *,
    cancellable: Cancellable = Cancellable.UNTIL_ACCEPTED,
    cancel_state: CancelState = CancelState.NOT_ASKED,
    n: int = 0,
) -> OperationRecord:
    return OperationRecord(
        id=f"run_x/{n}",
        run_id="run_x",
        tool="send",
        description="send the message",
        args_digest="d",
        status=status,
        cancellable=cancellable,
        can_verify=True,
        can_compensate=False,
        cancel_state=cancel_state,
        attempts=1,
        result=None,
        has_result=False,
        error=None,
        cause=None,
        evidence=(Evidence.local("gate"),),
        created_at=0.0,
        updated_at=0.0,
    )


# Each case: the statuses present, and the one headline they justify.
PRECEDENCE = [
    ([OpStatus.NEEDS_REVIEW, OpStatus.UNKNOWN, OpStatus.COMMITTED], Headline.NEEDS_REVIEW),
    ([OpStatus.COMPENSATION_FAILED], Headline.NEEDS_REVIEW),
    ([OpStatus.UNKNOWN, OpStatus.REQUESTED, OpStatus.COMMITTED], Headline.VERIFYING),
    ([OpStatus.REQUESTED, OpStatus.COMPENSATING], Headline.AWAITING_CONFIRMATION),
    ([OpStatus.REQUESTED], Headline.AWAITING_CONFIRMATION),
    # accepted, past the point its provider cancels: nobody asks it (R14, ADR 0093)
    ([OpStatus.ACCEPTED, OpStatus.COMPENSATING], Headline.VERIFYING),
    ([OpStatus.COMPENSATING, OpStatus.COMMITTED], Headline.CORRECTION_QUEUED),
    ([OpStatus.COMMITTED, OpStatus.COMPENSATED], Headline.STOPPED_WITH_COMPLETED_ACTIONS),
    ([OpStatus.COMPENSATED, OpStatus.PREVENTED], Headline.CORRECTED),
    ([OpStatus.PREVENTED, OpStatus.NOT_COMMITTED], Headline.CANCELED_BEFORE_EXTERNAL_ACTION),
    ([], Headline.CANCELED_BEFORE_EXTERNAL_ACTION),
]


@pytest.mark.parametrize(("statuses", "expected"), PRECEDENCE)
def test_r8_headline_precedence(statuses: list[OpStatus], expected: Headline) -> None:
    ops = [op(s, n=i) for i, s in enumerate(statuses)]
    assert headline_for(run_record(), ops) is expected


def test_r8_exact_messages_of_the_contract() -> None:
    assert HEADLINE_MESSAGES[Headline.CANCELED_BEFORE_EXTERNAL_ACTION] == (
        "Canceled before external action."
    )
    assert HEADLINE_MESSAGES[Headline.AWAITING_CONFIRMATION] == (
        "Cancellation requested; waiting for vendor confirmation."
    )
    assert HEADLINE_MESSAGES[Headline.CORRECTION_QUEUED] == (
        "Action had already completed; correction queued."
    )
    assert HEADLINE_MESSAGES[Headline.CORRECTED] == (
        "Action had already completed; it was corrected."
    )
    assert HEADLINE_MESSAGES[Headline.VERIFYING] == (
        "The action may already have happened; verifying before closing this run."
    )
    assert HEADLINE_MESSAGES[Headline.NEEDS_REVIEW] == "Status unknown; human review required."
    receipt = build_receipt(run_record(), [op(OpStatus.COMMITTED), op(OpStatus.COMMITTED, n=1)])
    assert receipt.message == "Stopped. 2 actions had already completed and were kept."


def test_r8_doubt_shows_even_on_a_completed_run() -> None:
    """A run that ended on its own still says 'verifying' while an outcome is unknown."""
    assert headline_for(run_record(RunState.COMPLETED), [op(OpStatus.UNKNOWN)]) is (
        Headline.VERIFYING
    )
    assert headline_for(run_record(RunState.COMPLETED), [op(OpStatus.COMMITTED)]) is (
        Headline.COMPLETED
    )


def test_r12_uncancellable_said_only_while_in_flight() -> None:
    in_flight = build_receipt(
        run_record(RunState.CANCELLING),
        [op(OpStatus.ACCEPTED, cancellable=Cancellable.UNTIL_ACCEPTED)],
    )
    assert "cannot cancel it once accepted" in in_flight.lines[0].provider_cancel
    done = build_receipt(run_record(), [op(OpStatus.COMMITTED, cancellable=Cancellable.NEVER)])
    assert done.lines[0].provider_cancel == ""
    still = build_receipt(run_record(RunState.CANCELLING), [op(OpStatus.REQUESTED)])
    assert still.lines[0].provider_cancel == "the provider can still cancel it"


def test_receipt_renders_text_and_json() -> None:
    receipt = build_receipt(run_record(), [op(OpStatus.PREVENTED)])
    text = receipt.text()
    assert text.splitlines()[0] == "Canceled before external action."
    assert "send the message: not sent: stopped at the dispatch gate" in text
    data = json.loads(receipt.json())
    assert data["headline"] == "canceled_before_external_action"
    assert data["operations"][0]["status"] == "prevented"
    assert data["operations"][0]["evidence"] == [{"kind": "local", "ref": "gate"}]
    assert data["settled"] is True


def test_an_outcome_still_recording_is_said_so() -> None:
    """ADR 0022: a response in hand whose record has not committed is "recording", and
    only while the records still show the call in flight."""
    ops = [op(OpStatus.REQUESTED, n=1), op(OpStatus.COMMITTED, n=2), op(OpStatus.REQUESTED, n=3)]
    receipt = build_receipt(run_record(RunState.RUNNING), ops, recording={"run_x/1", "run_x/2"})
    first, second, third = receipt.lines
    assert first.recording and "not yet durable" in first.status_words
    assert first.to_json()["recording"] is True
    assert not second.recording and second.status_words == "completed"
    assert not third.recording and third.status_words == "sent; no answer yet"


def test_a_lines_evidence_names_each_reference_once() -> None:
    """The demo's corrected share listed its correction's reference twice (the
    correction started, then its outcome): the line names the last three distinct
    references, in their order; the JSON keeps every record."""
    correction = Evidence.local("run_x/0~compensate", "correction started")
    done = Evidence.local("run_x/0~compensate", "corrected")
    shared = dataclasses.replace(
        op(OpStatus.COMPENSATED),
        evidence=(
            Evidence.local("gate"),
            Evidence(EvidenceKind.RESPONSE_DIGEST, "sha256:1"),
            correction,
            done,
        ),
    )
    (line,) = build_receipt(run_record(), [shared]).lines
    assert line.text().endswith(
        "[evidence: local:gate, response_digest:sha256:1, local:run_x/0~compensate]"
    )
    assert len(line.to_json()["evidence"]) == 4


def test_a_correction_of_a_completed_run_promises_nothing_of_the_run_closing() -> None:
    """A run that completed, one of its actions being corrected after it: its line said
    the correction's outcome "is verified before this run closes", of a run closed
    already. It says what settles a correction, whatever the run's state."""
    original = op(OpStatus.COMPENSATING, n=1)
    correction = dataclasses.replace(
        op(OpStatus.REQUESTED, n=2), compensates=original.id, id=f"{original.id}~compensate"
    )
    for state in (RunState.COMPLETED, RunState.CANCELLED, RunState.RUNNING):
        receipt = build_receipt(run_record(state), [original, correction])
        line = next(line for line in receipt.lines if line.op_id == original.id)
        assert (
            line.recovery
            == "correction queued; its outcome is recorded when it answers, else read back"
        )
        assert "closes" not in receipt.text()


def test_a_review_line_offers_not_committed_only_after_its_recorded_horizon() -> None:
    """R13/R14: before an operation's horizon a reviewer's "not committed" is refused
    (its effect may still land), so its line says when that decision can be made; the
    line of one with no horizon recorded offers both (ADR 0092)."""
    at = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC
    landing = dataclasses.replace(
        op(OpStatus.NEEDS_REVIEW), evidence=(Evidence.local("horizon", f"{at:.3f}"),)
    )
    line = build_receipt(run_record(), [landing]).lines[0]
    assert line.recovery == (
        "a reviewer decides committed, or not committed once its effect can no longer "
        "land (after 2027-01-15 08:00:00 UTC)"
    )
    plain = build_receipt(run_record(), [op(OpStatus.NEEDS_REVIEW)]).lines[0]
    assert plain.recovery == "a reviewer decides committed or not committed"


def test_a_horizon_of_another_day_is_said_with_its_date() -> None:
    """R13: a horizon is said as a time of day only when it is today's (UTC); one of
    another day carries its date. "until 00:34:11 UTC" said at 23:34 read as a time
    already past, where the effect may still land for an hour; receipts said it so,
    while the CLI's own view of the same horizon added the date."""
    evening = 1_796_686_440.0  # 2026-12-07 23:34:00 UTC
    assert horizon_words(evening + 60, now=evening) == "23:35:00 UTC"
    assert horizon_words(evening + 3600, now=evening) == "2026-12-08 00:34:00 UTC"
    assert horizon_words(evening - 86_400, now=evening) == "2026-12-06 23:34:00 UTC"
