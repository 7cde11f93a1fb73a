"""Spans and metrics emitted for S1, S3 and S9, read from the SDK's in-memory exporters.

Each test waits for the span it asserts on to end (a span processor sets an
event), never for a sleep.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import format_span_id, format_trace_id

import stopline
from stopline import Cancellable, EvidenceKind, Headline, OpStatus, PhaseKind, Policy
from stopline.telemetry import ATTR_OP_ID, ATTR_RUN_ID, ATTR_STATUS, Telemetry
from stopline.testing import FakeProvider
from tests.conftest import FAST_VERIFY
from tests.scenarios.workflows import Started, calls, start
from tests.support.held import Held


class EndSignals(SpanProcessor):
    """Sets an event when a span whose name starts with a prefix ends."""

    def __init__(self) -> None:
        self.waiting: dict[str, anyio.Event] = {}
        self.names: list[str] = []

    def ended(self, prefix: str) -> anyio.Event:
        """Set once a span named ``prefix...`` has ended (before or after this call)."""
        event = self.waiting.setdefault(prefix, anyio.Event())
        if any(name.startswith(prefix) for name in self.names):
            event.set()
        return event

    def on_end(self, span: ReadableSpan) -> None:
        self.names.append(span.name)
        for prefix, event in self.waiting.items():
            if span.name.startswith(prefix):
                event.set()


class Otel:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.signals = EndSignals()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.tracer_provider.add_span_processor(self.signals)
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.telemetry = Telemetry(self.tracer_provider, self.meter_provider)

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name.startswith(prefix)]

    def one(self, prefix: str) -> ReadableSpan:
        found = self.named(prefix)
        assert len(found) == 1, [s.name for s in self.spans.get_finished_spans()]
        return found[0]

    def points(self, metric: str) -> list[tuple[dict[str, Any], Any]]:
        """(attributes, data point) of one metric."""
        data = self.reader.get_metrics_data()
        out: list[tuple[dict[str, Any], Any]] = []
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for m in scope.metrics:
                    if m.name == metric:
                        out.extend((dict(p.attributes or {}), p) for p in m.data.data_points)
        return out

    def count(self, metric: str, **attributes: str) -> int:
        return sum(
            int(p.value)
            for attrs, p in self.points(metric)
            if all(attrs.get(f"stopline.{k}") == v for k, v in attributes.items())
        )


@pytest.fixture
def otel() -> Iterator[Otel]:
    made = Otel()
    yield made
    made.tracer_provider.shutdown()
    made.meter_provider.shutdown()


@pytest.fixture
async def traced(ledger_url: str, otel: Otel) -> AsyncIterator[stopline.Ledger]:
    async with stopline.open(ledger_url, verify=FAST_VERIFY, observers=[otel.telemetry]) as opened:
        yield opened


async def settled_and_traced(ledger: stopline.Ledger, otel: Otel, run_id: str) -> None:
    with anyio.fail_after(10):
        ended = otel.signals.ended("stopline.run")
        await ledger.wait_settled(run_id)
        await ended.wait()


async def test_s01_spans_prevented_at_the_gate(
    traced: stopline.Ledger, otel: Otel, ledger_url: str
) -> None:
    """Cancelled from another connection (as the CLI does) while the agent thinks."""
    send = FakeProvider("send")
    thinking = anyio.Event()

    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.FINALIZING):  # at_boundary: not interrupted
            await thinking.wait()
            await run.call(send.tool, "hello")  # no boundary in between: the gate decides

    async with anyio.create_task_group() as tg:
        started = start(tg, traced, body)
        await started.ready.wait()
        async with stopline.open(ledger_url, observers=[otel.telemetry]) as elsewhere:
            await elsewhere.cancel(started.run_id, by="user:1", reason="stop")
        thinking.set()
    await settled_and_traced(traced, otel, started.run_id)

    run = otel.one("stopline.run")
    assert run.attributes is not None
    assert run.attributes[ATTR_RUN_ID] == started.run_id
    assert run.attributes[ATTR_STATUS] == "cancelled"
    assert run.attributes["stopline.headline"] == Headline.CANCELED_BEFORE_EXTERNAL_ACTION.value
    cancel = otel.one("stopline.cancel")
    assert cancel.attributes is not None and cancel.attributes["stopline.by"] == "user:1"
    dispatch = otel.one("stopline.dispatch")
    assert dispatch.attributes is not None and dispatch.attributes["stopline.gate"] == "prevented"
    op = otel.one("stopline.operation")
    assert op.attributes is not None
    assert op.attributes[ATTR_STATUS] == OpStatus.PREVENTED.value
    assert str(op.attributes[ATTR_OP_ID]).startswith(started.run_id)
    assert dispatch.parent is not None and dispatch.parent.span_id == op.context.span_id
    settle = otel.one("stopline.settle")
    assert settle.parent is not None and settle.parent.span_id == cancel.context.span_id
    assert otel.one("stopline.phase").attributes == {
        ATTR_RUN_ID: started.run_id,
        "stopline.policy": "at_boundary",
        ATTR_STATUS: "cancelled",  # a phase ends with the next one or with the run
    }
    assert otel.count("stopline.gate.decisions", gate="prevented") == 1
    assert otel.count("stopline.runs.outcomes", headline="canceled_before_external_action") == 1
    [(_, histogram)] = otel.points("stopline.cancel.settle_time")
    assert histogram.count == 1
    assert send.requests == []


async def test_a_parents_outcome_is_its_receipts_headline(
    traced: stopline.Ledger, otel: Otel
) -> None:
    """The outcome counted for a run, and its span's headline, came from the run's own
    operations: a parent whose exclusively owned child had committed an action was
    counted "canceled before external action" while its receipt said otherwise."""
    wire = FakeProvider("wire", cancellable=Cancellable.NEVER)
    async with traced.run("parent", owner="user:1", run_id="run-p") as run:
        async with run.child("child", run_id="run-c") as child:
            await child.call(wire.tool, 5)
        await traced.cancel("run-p", by="user:1")
    await settled_and_traced(traced, otel, "run-p")
    receipt = await traced.receipt("run-p")
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    (parent,) = [
        s for s in otel.named("stopline.run") if (s.attributes or {})[ATTR_RUN_ID] == "run-p"
    ]
    assert (parent.attributes or {})["stopline.headline"] == receipt.headline.value
    assert otel.count("stopline.runs.outcomes", headline=receipt.headline.value) >= 1
    assert otel.count("stopline.runs.outcomes", headline="canceled_before_external_action") == 0


async def test_s03_spans_unknown_then_verified(traced: stopline.Ledger, otel: Otel) -> None:
    notify = FakeProvider("notify", cancellable=Cancellable.NEVER)
    held = notify.hold("committed")
    async with anyio.create_task_group() as tg:
        started = start(tg, traced, calls(notify, policy=Policy.IMMEDIATE))
        await held.reached.wait()
        await traced.cancel(started.run_id, by="user:1")
    await settled_and_traced(traced, otel, started.run_id)

    op_span = otel.one("stopline.operation notify")
    assert op_span.attributes is not None
    assert op_span.attributes[ATTR_STATUS] == OpStatus.COMMITTED.value
    events = [e.name for e in op_span.events]
    assert events.index("stopline.lost") < events.index("stopline.verified_committed")
    verify = otel.one("stopline.verify")
    assert verify.parent is not None and verify.parent.span_id == op_span.context.span_id
    assert verify.attributes is not None
    assert verify.attributes[ATTR_STATUS] == OpStatus.COMMITTED.value
    assert verify.attributes["stopline.event"] == "verified_committed"
    # the receipt links into the trace
    receipt = await traced.receipt(started.run_id)
    pointer = (
        f"{format_trace_id(op_span.context.trace_id)}:{format_span_id(op_span.context.span_id)}"
    )
    assert any(e.kind is EvidenceKind.SPAN and e.ref == pointer for e in receipt.lines[0].evidence)
    assert otel.one("stopline.run").attributes == otel.one("stopline.run").attributes
    assert otel.count("stopline.unknowns.resolved", resolved_by="read_back") == 1
    assert otel.count("stopline.operations.outcomes", status="committed") == 1
    headline = Headline.STOPPED_WITH_COMPLETED_ACTIONS.value
    assert otel.count("stopline.runs.outcomes", headline=headline) == 1


async def test_s09_spans_late_success_kept(traced: stopline.Ledger, otel: Otel) -> None:
    remote_done = anyio.Event()
    accepted = anyio.Event()

    @stopline.tool(cancellable=Cancellable.NEVER)
    async def pay(ctx: stopline.CallContext, amount: int) -> str:
        await ctx.accepted(ref="psp:1")
        accepted.set()
        await remote_done.wait()
        return "paid"

    @pay.verifier
    async def _(ctx: stopline.CallContext) -> stopline.ReadBack:
        return stopline.ReadBack(stopline.Verdict.UNKNOWN, detail="still processing")

    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
            await run.call(pay, 100)

    async with anyio.create_task_group() as tg:
        started = start(tg, traced, body)
        await accepted.wait()
        await traced.cancel(started.run_id, by="user:1")
    op = (await traced.backend.operations(started.run_id))[0]
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
    op_ended = otel.signals.ended("stopline.operation pay")
    late = await traced.late_response(op.id, stopline.Verdict.COMMITTED, result="paid", ref="psp:1")
    assert late.status is OpStatus.COMMITTED
    with anyio.fail_after(10):
        await op_ended.wait()
    await settled_and_traced(traced, otel, started.run_id)

    op_span = otel.one("stopline.operation pay")
    assert op_span.attributes is not None
    assert op_span.attributes[ATTR_STATUS] == OpStatus.COMMITTED.value
    assert op_span.attributes["stopline.late"] is True
    committed = [e for e in op_span.events if e.name == "stopline.committed"]
    assert committed and committed[0].attributes is not None and committed[0].attributes["late"]
    assert [e.name for e in op_span.events].count("stopline.accepted") == 1
    assert otel.count("stopline.unknowns.resolved", resolved_by="late_response") == 1
    assert otel.count("stopline.unknowns.resolved", resolved_by="read_back") == 0
    assert started.entries == 1
    assert len(otel.named("stopline.run")) == 1  # the workflow was not restarted


async def test_s08_compensation_span(traced: stopline.Ledger, otel: Otel) -> None:
    """A correction opens a compensate span on the corrected operation and ends it."""
    undone: list[str] = []
    send = FakeProvider("send", cancellable=Cancellable.NEVER)

    @send.tool.compensator
    async def _(ctx: Any) -> str:
        undone.append(ctx.compensates)
        return "deleted"

    async with traced.run("notify", owner="user:1") as run:
        await run.call(send.tool, "hello")
    op = (await traced.backend.operations(run.id))[0]
    with anyio.fail_after(10):
        ended = otel.signals.ended("stopline.compensate")
        corrected = await traced.compensate(op.id, by="user:1")
        await ended.wait()
    assert corrected.status is OpStatus.COMPENSATED
    span = otel.one("stopline.compensate")
    assert span.attributes is not None and span.attributes[ATTR_OP_ID] == op.id
    assert span.attributes[ATTR_STATUS] == OpStatus.COMPENSATED.value
    assert undone == [op.id]


async def test_an_observer_keeps_deferred_outcomes_and_traces_them(
    ledger_url: str, otel: Otel
) -> None:
    """``durable_outcomes=False`` (ADR 0006) survives an observer, and is still traced."""
    send = FakeProvider("send")
    async with stopline.open(
        ledger_url, observers=[otel.telemetry], durable_outcomes=False
    ) as ledger:
        assert ledger.backend.defers_outcomes  # the observer did not drop the option
        async with ledger.run("deferred", owner="user:1") as run:
            await run.call(send.tool, "hello")
        with anyio.fail_after(10):
            await otel.signals.ended("stopline.operation").wait()
    op = otel.one("stopline.operation")
    assert op.attributes is not None and op.attributes[ATTR_STATUS] == "committed"


async def test_the_cancel_span_ends_at_the_fences_commit(
    traced: stopline.Ledger, otel: Otel
) -> None:
    """On SQLite a cancel's calls are cut as its fence commits, before the backend's
    cancel returns (ADR 0043): the span ends at the commit, before the call's first
    step after it, as before that change."""
    held = Held(traced)
    async with held.in_flight():
        await traced.cancel(held.ids[0], by="u")
    span = otel.one("stopline.cancel")
    assert span.end_time is not None and 0 < span.end_time <= held.interrupted_ns


async def test_a_reviewed_runs_new_headline_is_traced_under_its_run(
    traced: stopline.Ledger, otel: Otel
) -> None:
    """A run that ended in review has its span end with "needs_review", true then; once
    a reviewer decides, a ``stopline.outcome`` span under the run's carries the headline
    the receipt now has (the trace and the metrics stayed at "needs_review" for ever)."""
    pay = FakeProvider("charge", cancellable=Cancellable.NEVER, verifiable=False)
    held = pay.hold("committed")
    async with anyio.create_task_group() as tg:
        started = start(tg, traced, calls(pay, policy=Policy.IMMEDIATE))
        await held.reached.wait()
        await traced.cancel(started.run_id, by="user:1")
        held.release()
    await settled_and_traced(traced, otel, started.run_id)
    run_span = otel.one("stopline.run")
    assert (run_span.attributes or {})["stopline.headline"] == Headline.NEEDS_REVIEW.value
    assert otel.named("stopline.outcome") == []

    [item] = await traced.review_items()
    outcome_ended = otel.signals.ended("stopline.outcome")
    await traced.resolve_review(item.op.id, "committed", by="user:1", note="it charged")
    receipt = await traced.wait_settled(started.run_id, timeout=10)
    with anyio.fail_after(10):
        await outcome_ended.wait()
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    outcome = otel.one("stopline.outcome")
    assert outcome.attributes == {
        ATTR_RUN_ID: started.run_id,
        "stopline.previous": Headline.NEEDS_REVIEW.value,
        ATTR_STATUS: "cancelled",
        "stopline.headline": receipt.headline.value,
    }
    assert outcome.parent is not None and outcome.parent.span_id == run_span.context.span_id
    assert outcome.context.trace_id == run_span.context.trace_id
    assert otel.count("stopline.runs.revised", headline=receipt.headline.value) == 1


async def test_a_completed_runs_read_back_outcome_is_traced(
    traced: stopline.Ledger, otel: Otel
) -> None:
    """A run that completed while a call of it was in doubt ended "verifying"; the
    read-back that settles the call later changes its receipt, and the trace says so."""
    found = [stopline.Verdict.UNKNOWN]

    @stopline.tool(cancellable=Cancellable.NEVER)
    async def wire(ctx: stopline.CallContext, amount: int) -> str:
        raise ConnectionError("the answer was lost")

    @wire.verifier
    async def _(ctx: stopline.CallContext) -> stopline.ReadBack:
        return stopline.ReadBack(found[0], detail="read back")

    async with traced.run("job", owner="user:1") as run:
        with pytest.raises(ConnectionError):
            await run.call(wire, 5)
    with anyio.fail_after(10):
        await otel.signals.ended("stopline.run").wait()
    run_span = otel.one("stopline.run")
    assert (run_span.attributes or {})["stopline.headline"] == Headline.VERIFYING.value

    found[0] = stopline.Verdict.COMMITTED
    [op] = await traced.backend.operations(run.id)
    await traced.verify(op.id)
    receipt = await traced.wait_settled(run.id, timeout=10)
    assert receipt.headline is Headline.COMPLETED
    with anyio.fail_after(10):
        await otel.signals.ended("stopline.outcome").wait()
    last = otel.named("stopline.outcome")[-1]
    assert (last.attributes or {})["stopline.headline"] == Headline.COMPLETED.value
    assert (last.attributes or {})[ATTR_STATUS] == "completed"
    assert last.parent is not None and last.parent.span_id == run_span.context.span_id
    assert otel.count("stopline.runs.revised", headline=Headline.COMPLETED.value) == 1
