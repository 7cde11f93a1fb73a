"""Probe 8, small truths, on a real ledger (SQLite and PostgreSQL).

- ``ctx.progress`` is advisory: what a tool reports is kept bounded and storable, and
  never fails the call it reports on (a nested list failed the write inside the tool,
  and the call, which went on, was recorded ``unknown``; a 10 MB message was written
  whole; a lone surrogate and control characters were kept raw).
- A key one character too long for its run says the room the run's id leaves it: the
  limit is the operation id's (``RUN_ID/KEY``), and the refusal counted the whole id
  but named the key ("1027 characters; at most 1024" for a key of 1,024).
- A run in review has not ended: its ``RunEnded`` says "is in review", and what to do.
- A settled cancel that later evidence sends back to review (ADR 0093) is counted as
  ended once by telemetry, its settle time the first settle's (the SDK's in-memory
  reader).
"""

from __future__ import annotations

import logging
import math
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest

import stopline
from stopline import OpStatus, RunState, Verdict
from stopline.domain.limits import MAX_ID_CHARS, MAX_REASON_CHARS
from stopline.domain.model import EventRecord, OperationRecord
from stopline.domain.vocab import NoteKind
from stopline.errors import LedgerUnavailable
from stopline.ledger.forwarding import ForwardingBackend
from tests.conftest import FAST_VERIFY
from tests.rules.test_probe8_runtime import Psp, _cancelled_lost
from tests.surfaces.test_telemetry import Otel
from tests.truth.helpers import quiesce

pytestmark = pytest.mark.timeout(60)


def reporter(*reports: tuple[Any, Any, Any]) -> stopline.Tool[str]:
    """A tool that reports each ``(progress, total, message)`` and then answers."""

    async def work(ctx: stopline.CallContext) -> str:
        for progress, total, message in reports:
            await ctx.progress(progress, total, message)
        return "done"

    tool: stopline.Tool[str] = stopline.Tool(work, name="work")
    tool.wants_context = True
    return tool


async def progress_of(ledger: stopline.Ledger, run_id: str) -> list[dict[str, Any]]:
    events: list[EventRecord] = await ledger.backend.events(run_id)
    return [dict(e.data) for e in events if e.kind == NoteKind.PROGRESS]


async def test_a_progress_message_is_kept_bounded_and_printable(ledger: stopline.Ledger) -> None:
    long = "x" * 1_000_000
    raw = "half \ud800 way\x1b[31m\x00 red\u009b\n"
    async with ledger.run("job", owner="user:1", run_id="msg") as run:
        assert await run.call(reporter((1, 2, long), (2, 2, raw)), key="k") == "done"
    first, second = await progress_of(ledger, "msg")
    assert len(first["message"]) == MAX_REASON_CHARS
    assert first["message"].endswith("\u2026")
    assert second["message"] == "half \ufffd way\ufffd[31m\ufffd red\ufffd\n"
    assert (await ledger.backend.get_operation("msg/k")).status is OpStatus.COMMITTED


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (10**400, None),  # past a float's range: a bounded text, checked below
        ("half", "'half'"),
        (True, "True"),
        ([1, [2]], "[1, [2]]"),
    ],
    ids=["nan", "inf", "huge-int", "str", "bool", "list"],
)
async def test_progress_that_is_no_number_is_kept_as_text_and_the_call_stands(
    ledger: stopline.Ledger, given: object, kept: str | None
) -> None:
    async with ledger.run("job", owner="user:1", run_id="odd") as run:
        assert await run.call(reporter((given, given, "")), key="k") == "done"
    (data,) = await progress_of(ledger, "odd")
    assert isinstance(data["progress"], str) and data["progress"] == data["total"]
    assert len(data["progress"]) <= 64
    if kept is not None:
        assert data["progress"] == kept


async def test_progress_nested_past_the_ledgers_bound_never_fails_its_call(
    ledger: stopline.Ledger,
) -> None:
    """A list 300 deep (past what the ledger writes, 256) raised ``RecursionError``
    inside the tool: a call that went on to answer was recorded ``unknown``."""
    deep: list[Any] = []
    for _ in range(300):
        deep = [deep]
    async with ledger.run("job", owner="user:1", run_id="deep") as run:
        assert await run.call(reporter((deep, None, "step")), key="k") == "done"
    (data,) = await progress_of(ledger, "deep")
    assert data["progress"].startswith("[[[") and len(data["progress"]) <= 64
    assert (data["total"], data["message"]) == (None, "step")
    assert (await ledger.backend.get_operation("deep/k")).status is OpStatus.COMMITTED


async def test_real_numbers_are_kept_as_given(ledger: stopline.Ledger) -> None:
    """Guards what held: a finite int stays an int, a float a float."""
    async with ledger.run("job", owner="user:1", run_id="num") as run:
        await run.call(reporter((3, 10, "a"), (0.5, None, "b"), (-1, 2.0**60, "c")), key="k")
    assert await progress_of(ledger, "num") == [
        {"progress": 3, "total": 10, "message": "a"},
        {"progress": 0.5, "total": None, "message": "b"},
        {"progress": -1, "total": 2.0**60, "message": "c"},
    ]
    for data in await progress_of(ledger, "num"):
        assert type(data["progress"]) in (int, float) and math.isfinite(data["progress"])


async def test_a_decimal_or_a_fraction_is_kept_as_a_number(ledger: stopline.Ledger) -> None:
    async with ledger.run("job", owner="user:1", run_id="dec") as run:
        await run.call(reporter((Decimal("2.5"), Fraction(1, 4), "")), key="k")
    assert await progress_of(ledger, "dec") == [{"progress": 2.5, "total": 0.25, "message": ""}]


async def test_a_progress_the_ledger_cannot_write_is_logged_and_the_call_stands(
    ledger_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The ledger refusing the progress note (it is full, say) is logged; the tool goes
    on and its answer is recorded: the report never fails the effect it reports on."""

    class NoProgress(ForwardingBackend):
        async def note(
            self, op_id: str, kind: str, data: dict[str, Any], cancel_state: str | None = None
        ) -> OperationRecord:
            if kind == NoteKind.PROGRESS:
                raise LedgerUnavailable("progress", "disk full")
            return await self.inner.note(op_id, kind, data, cancel_state)

    caplog.set_level(logging.WARNING, logger="stopline.background")
    async with stopline.open(ledger_url, verify=FAST_VERIFY, observers=[NoProgress]) as ledger:
        async with ledger.run("job", owner="user:1", run_id="full") as run:
            assert await run.call(reporter((1, 2, "half")), key="k") == "done"
        assert (await ledger.backend.get_operation("full/k")).status is OpStatus.COMMITTED
    assert any("recording progress of 'full/k'" in r.getMessage() for r in caplog.records)


async def test_a_key_too_long_for_its_run_says_the_room_its_run_leaves(
    ledger: stopline.Ledger,
) -> None:
    @stopline.tool(name="pay")
    async def pay() -> str:
        return "paid"

    room = MAX_ID_CHARS - len("run-1") - 1
    async with ledger.run("job", owner="user:1", run_id="run-1") as run:
        assert await run.call(pay, key="k" * room) == "paid"  # which keys fit: as ever
        for key in ("k" * (room + 1), "k" * MAX_ID_CHARS):
            with pytest.raises(stopline.InvalidInput) as refused:
                await run.call(pay, key=key)
            assert refused.value.what == "key"
            assert str(refused.value) == (
                f"invalid key: {len(key)} characters; a call's operation id (the run's id, "
                f"'/', the key) has at most {MAX_ID_CHARS}, so a key in this run (an id of 5 "
                f"characters) has at most {room}"
            )
    ops = await ledger.backend.operations("run-1")
    assert [op.id for op in ops] == [f"run-1/{'k' * room}"]  # nothing else written


async def test_a_call_without_a_key_too_long_for_its_run_names_the_tool(
    ledger: stopline.Ledger,
) -> None:
    @stopline.tool(name="pay")
    async def pay() -> str:
        return "paid"

    run_id = "r" * (MAX_ID_CHARS - 4)
    async with ledger.run("job", owner="user:1", run_id=run_id) as run:
        with pytest.raises(stopline.InvalidInput) as refused:
            await run.call(pay)
        assert refused.value.what == "tool"
        assert "would have 1026 characters, at most 1024" in str(refused.value)
        assert str(refused.value).endswith("give the call a key of at most 3")
        assert await run.call(pay, key="abc") == "paid"


async def test_a_run_in_review_is_said_to_be_in_review_not_ended(
    ledger: stopline.Ledger,
) -> None:
    """Entering it, resuming it, pausing it: each says "is in review" and, where there
    is more to do, to decide its review items first."""
    psp = Psp()
    op_id = await _cancelled_lost(ledger, psp, "rev")
    await ledger.late_response(op_id, Verdict.COMMITTED, ref="psp-1", result="paid")
    await quiesce(ledger)
    assert (await ledger.backend.get_run("rev")).state is RunState.NEEDS_REVIEW

    with pytest.raises(stopline.RunEnded) as entered:
        async with ledger.run("pay", owner="user:1", run_id="rev"):
            pass
    with pytest.raises(stopline.RunEnded) as resumed:
        await ledger.resume("rev", by="user:1")
    with pytest.raises(stopline.RunEnded) as paused:
        await ledger.pause("rev", by="user:1")
    for raised in (entered, resumed):
        said = str(raised.value)
        assert said.startswith("run 'rev' is in review (needs_review): resolve its review")
    assert str(paused.value) == "run 'rev' is in review (needs_review): nothing runs in it to pause"
    assert "has ended" not in str(entered.value) + str(resumed.value) + str(paused.value)


def test_run_ended_of_other_states_keeps_its_words() -> None:
    """Guards what held: ended runs "have ended", a run being cancelled "is stopped"."""
    assert (
        str(stopline.RunEnded("a", RunState.COMPLETED, "x")) == "run 'a' has ended (completed): x"
    )
    assert str(stopline.RunEnded("a", RunState.SETTLING, "x")) == "run 'a' is stopped (settling): x"


async def test_a_reopened_cancel_is_counted_as_ended_once(ledger_url: str) -> None:
    """cancelled -> needs_review (a late answer contradicts the read-back) -> cancelled
    (the reviewer's decision): one outcome, one settle time (the first settle's), one
    ``stopline.settle`` span; the reopening is counted as one."""
    otel = Otel()
    try:
        async with stopline.open(
            ledger_url, verify=FAST_VERIFY, observers=[otel.telemetry]
        ) as ledger:
            op_id = await _cancelled_lost(ledger, Psp(), "again")
            await quiesce(ledger)
            assert otel.count("stopline.runs.outcomes") == 1
            (first,) = [p.sum for _, p in otel.points("stopline.cancel.settle_time")]
            await ledger.late_response(op_id, Verdict.COMMITTED, ref="psp-1", result="paid")
            await quiesce(ledger)
            assert (await ledger.backend.get_run("again")).state is RunState.NEEDS_REVIEW
            await ledger.resolve_review(op_id, "committed", by="user:1", note="paid")
            await quiesce(ledger)
            assert (await ledger.backend.get_run("again")).state is RunState.CANCELLED
        assert otel.count("stopline.runs.outcomes") == 1
        assert [(p.count, p.sum) for _, p in otel.points("stopline.cancel.settle_time")] == [
            (1, first)
        ]
        assert len(otel.named("stopline.settle")) == 1
        assert otel.count("stopline.runs.reopened") == 1
    finally:
        otel.tracer_provider.shutdown()
        otel.meter_provider.shutdown()


async def test_a_cancel_in_review_as_it_settles_is_one_end(ledger_url: str) -> None:
    """Guards what held: ``settling -> needs_review`` is the run's end (counted once, with
    its settle time), not a reopening."""
    otel = Otel()
    try:
        async with stopline.open(
            ledger_url, verify=FAST_VERIFY, observers=[otel.telemetry]
        ) as ledger:

            @stopline.tool(name="pay")
            async def pay() -> str:
                raise ConnectionResetError("dropped")  # no read-back: review

            async with ledger.run("pay", owner="user:1", run_id="doubt") as run:
                with pytest.raises(ConnectionResetError):
                    await run.call(pay, key="p")
                await ledger.cancel(run.id, by="user:1")
            await ledger.wait_settled("doubt", timeout=30)
            await quiesce(ledger)
            assert (await ledger.backend.get_run("doubt")).state is RunState.NEEDS_REVIEW
        assert otel.count("stopline.runs.outcomes", headline="needs_review") == 1
        assert [p.count for _, p in otel.points("stopline.cancel.settle_time")] == [1]
        assert otel.count("stopline.runs.reopened") == 0
    finally:
        otel.tracer_provider.shutdown()
        otel.meter_provider.shutdown()
