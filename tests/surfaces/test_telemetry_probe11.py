"""Probe 11: ``stopline.runs.revised`` follows a settled cancel that later evidence reopens.

A cancelled run settles with a headline (counted once in ``stopline.runs.outcomes``).
A late answer or a read-back contradicting one of its calls sends it back to review
(ADR 0093), and the reviewer's decision settles it again, often with another headline.
The observer stopped following a run once its headline could no longer change, so
neither move was counted: ``runs.outcomes`` + revised to − revised from, the outcomes
as they are now (docs/telemetry.md), kept the first headline for ever. Now the
contradiction's write starts following the run again, from the headline it had: each
change of headline is one revision, its ``previous`` the headline counted before it.
Real SQLite ledger, the SDK's in-memory metric reader and span exporter.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

import stopline
from stopline import Headline, RunState, Verdict
from tests.conftest import FAST_VERIFY
from tests.rules.test_probe8_runtime import Psp, _cancelled_lost
from tests.surfaces.test_telemetry import Otel
from tests.truth.helpers import quiesce

pytestmark = pytest.mark.timeout(60)

CBEA = Headline.CANCELED_BEFORE_EXTERNAL_ACTION.value
SWCA = Headline.STOPPED_WITH_COMPLETED_ACTIONS.value
REVIEW = Headline.NEEDS_REVIEW.value


def outcomes_now(otel: Otel) -> Counter[str]:
    """The runs by headline as they are now, by the docs' rule: ``runs.outcomes`` +
    revised to − revised from."""
    now: Counter[str] = Counter()
    for attrs, point in otel.points("stopline.runs.outcomes"):
        now[attrs["stopline.headline"]] += int(point.value)
    for attrs, point in otel.points("stopline.runs.revised"):
        now[attrs["stopline.headline"]] += int(point.value)
        now[attrs["stopline.previous"]] -= int(point.value)
    return +now  # the headlines no run has any more are left out


def revisions(otel: Otel) -> list[tuple[str, str, int]]:
    """(previous, headline, count) of each ``stopline.runs.revised`` point, sorted."""
    return sorted(
        (str(attrs["stopline.previous"]), str(attrs["stopline.headline"]), int(point.value))
        for attrs, point in otel.points("stopline.runs.revised")
    )


@pytest.fixture
def otel() -> Iterator[Otel]:
    made = Otel()
    yield made
    made.tracer_provider.shutdown()
    made.meter_provider.shutdown()


async def test_a_reopened_cancel_counts_each_new_headline(ledger_url: str, otel: Otel) -> None:
    """Settled "canceled before external action" (the read-back found no payment), a late
    answer says it was paid: review (one revision), then the reviewer's "committed":
    "stopped with completed actions" (a second, from review). Neither was counted."""
    async with stopline.open(ledger_url, verify=FAST_VERIFY, observers=[otel.telemetry]) as ledger:
        op_id = await _cancelled_lost(ledger, Psp(), "again")
        await quiesce(ledger)
        assert outcomes_now(otel) == {CBEA: 1}

        await ledger.late_response(op_id, Verdict.COMMITTED, ref="psp-1", result="paid")
        await quiesce(ledger)
        assert (await ledger.backend.get_run("again")).state is RunState.NEEDS_REVIEW
        assert revisions(otel) == [(CBEA, REVIEW, 1)]
        assert outcomes_now(otel) == {REVIEW: 1}

        await ledger.resolve_review(op_id, "committed", by="user:1", note="paid")
        await quiesce(ledger)
        receipt = await ledger.receipt("again")
    assert receipt.run_state is RunState.CANCELLED and receipt.headline.value == SWCA
    assert revisions(otel) == [(CBEA, REVIEW, 1), (REVIEW, SWCA, 1)]
    assert outcomes_now(otel) == {SWCA: 1}
    assert otel.count("stopline.runs.outcomes") == 1  # still one end (ADR 0093)
    assert otel.count("stopline.runs.reopened") == 1
    said = [
        ((s.attributes or {})["stopline.previous"], (s.attributes or {})["stopline.headline"])
        for s in otel.named("stopline.outcome")
    ]
    assert said == [(CBEA, REVIEW), (REVIEW, SWCA)]


async def test_a_run_reviewed_then_reopened_keeps_its_previous_true(
    ledger_url: str, otel: Otel
) -> None:
    """A run that ended in review is followed until its reviewer settles it; reopened
    after that by a late refusal, its next revisions start from the headline the review
    gave it, not from one it had before."""
    async with stopline.open(ledger_url, verify=FAST_VERIFY, observers=[otel.telemetry]) as ledger:

        @stopline.tool(name="pay")
        async def pay() -> str:
            raise ConnectionResetError("dropped")  # no read-back: review

        async with ledger.run("pay", owner="user:1", run_id="twice") as run:
            with pytest.raises(ConnectionResetError):
                await run.call(pay, key="p")
            await ledger.cancel(run.id, by="user:1")
        await ledger.wait_settled("twice", timeout=30)
        await quiesce(ledger)
        op_id = "twice/p"
        assert outcomes_now(otel) == {REVIEW: 1}

        await ledger.resolve_review(op_id, "committed", by="user:1", note="it paid")
        await quiesce(ledger)
        assert revisions(otel) == [(REVIEW, SWCA, 1)]

        await ledger.late_response(op_id, Verdict.NOT_COMMITTED, ref="psp-void")
        await quiesce(ledger)
        await ledger.resolve_review(op_id, "not_committed", by="user:1", note="voided")
        await quiesce(ledger)
        receipt = await ledger.receipt("twice")
    assert receipt.headline.value == CBEA
    assert revisions(otel) == [(REVIEW, CBEA, 1), (REVIEW, SWCA, 1), (SWCA, REVIEW, 1)]
    assert outcomes_now(otel) == {CBEA: 1}
    assert otel.count("stopline.runs.outcomes") == 1


async def test_a_completed_runs_contradicted_call_is_a_revision(
    ledger_url: str, otel: Otel
) -> None:
    """A run that ended on its own is not reopened (ADR 0093), but its receipt's headline
    does go to review when a late refusal contradicts its call, and back once a
    reviewer decides: two revisions, where none was counted."""
    psp = Psp(drops=False)
    completed = Headline.COMPLETED.value
    async with stopline.open(ledger_url, verify=FAST_VERIFY, observers=[otel.telemetry]) as ledger:
        async with ledger.run("pay", owner="user:1", run_id="done") as run:
            await run.call(psp.tool, 25, key="pay")
        await quiesce(ledger)
        assert outcomes_now(otel) == {completed: 1}

        await ledger.late_response("done/pay", Verdict.COMMITTED, ref="psp-again")
        await quiesce(ledger)
        assert revisions(otel) == []  # agreeing evidence: kept, nothing changed

        await ledger.late_response("done/pay", Verdict.NOT_COMMITTED, ref="psp-void")
        await quiesce(ledger)
        assert (await ledger.backend.get_run("done")).state is RunState.COMPLETED
        assert revisions(otel) == [(completed, REVIEW, 1)]
        await ledger.resolve_review("done/pay", "committed", by="user:1", note="it paid")
        await quiesce(ledger)
    assert revisions(otel) == [(completed, REVIEW, 1), (REVIEW, completed, 1)]
    assert outcomes_now(otel) == {completed: 1}
