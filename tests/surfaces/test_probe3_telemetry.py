"""Telemetry never fails what it observes: a span processor or a metric hook of the
real OpenTelemetry SDK that raises leaves the call, the cancel, the run and the
ledger's close as they would be without it, and the failure is logged.

The SDK calls span processors (``on_start``, ``on_end``) and the exemplar filter
inline, without catching. Before, such an exception left ``TracedBackend`` after the
ledger's write had committed: a gate that had passed raised before the tool was
called (the operation stayed ``requested``, the run failed), a completed run's
``async with`` raised, a committed cancel raised to its caller, and a close with
spans still open skipped the backend's own close.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import ExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util.types import Attributes

import stopline
from stopline import Headline, OpStatus, PhaseKind, Policy, Receipt
from stopline.ledger.backend import RunSpec
from stopline.telemetry import Telemetry
from stopline.testing import FakeProvider
from tests.support.held import Held


class Raising(SpanProcessor):
    """Raises when a span whose name starts with ``prefix`` starts or ends."""

    def __init__(self, when: str, prefix: str) -> None:
        self.when = when
        self.prefix = prefix
        self.raised = 0

    def _maybe(self, when: str, name: str) -> None:
        if when == self.when and name.startswith(self.prefix):
            self.raised += 1
            raise RuntimeError(f"processor {when} {name}")

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._maybe("start", span.name)

    def on_end(self, span: ReadableSpan) -> None:
        self._maybe("end", span.name)


class RaisingExemplars(ExemplarFilter):
    """A user's exemplar filter that raises: the SDK calls it on every measurement."""

    def should_sample(
        self,
        value: int | float,
        time_unix_nano: int,
        attributes: Attributes,
        context: Context,
    ) -> bool:
        raise RuntimeError("exemplar filter")


class Otel:
    def __init__(self, processor: SpanProcessor | None = None, *, meter: bool = False) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        if processor is not None:
            self.tracer_provider.add_span_processor(processor)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(
            metric_readers=[self.reader], exemplar_filter=RaisingExemplars() if meter else None
        )
        self.telemetry = Telemetry(self.tracer_provider, self.meter_provider)

    def names(self) -> list[str]:
        return [s.name for s in self.spans.get_finished_spans()]

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def failures(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.WARNING, logger="stopline.telemetry"):
        yield caplog


def _logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "stopline.telemetry"]


SPANS = [
    "stopline.run",
    "stopline.phase",
    "stopline.operation",
    "stopline.dispatch",
]


@pytest.mark.parametrize("when", ["start", "end"])
@pytest.mark.parametrize("prefix", SPANS)
async def test_a_raising_span_processor_fails_no_call_and_no_run(
    ledger_url: str, when: str, prefix: str, failures: pytest.LogCaptureFixture
) -> None:
    raising = Raising(when, prefix)
    otel = Otel(raising)
    send = FakeProvider("send")
    try:
        async with stopline.open(ledger_url, observers=[otel.telemetry]) as ledger:
            async with (
                ledger.run("job", owner="user:1") as run,
                run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),
            ):
                await run.call(send.tool, "hello")
            receipt = await ledger.receipt(run.id)
            [op] = await ledger.backend.operations(run.id)
    finally:
        otel.shutdown()
    assert raising.raised >= 1  # the processor did raise
    assert len(send.requests) == 1  # the call went out once
    assert op.status is OpStatus.COMMITTED
    assert receipt.headline is Headline.COMPLETED
    assert any(prefix in message for message in _logged(failures))
    # the other spans were still exported (the SDK stops a span's processors at the one
    # that raised: that span's exporter, added after it, did not see it)
    for other in SPANS:
        if other != prefix:
            assert any(name.startswith(other) for name in otel.names()), other


async def _cut_and_settled(ledger: stopline.Ledger) -> tuple[Held, Receipt, Receipt]:
    """A held call cut by a cancel: the cancel's receipt, and the settled one."""
    held = Held(ledger)
    async with held.in_flight():
        receipt = await ledger.cancel(held.ids[0], by="u")
    with anyio.fail_after(10):
        return held, receipt, await ledger.wait_settled(held.ids[0])


@pytest.mark.parametrize("when", ["start", "end"])
@pytest.mark.parametrize("prefix", ["stopline.cancel", "stopline.settle", "stopline.verify"])
async def test_a_raising_span_processor_fails_no_cancel(
    ledger_url: str, tmp_path: Path, when: str, prefix: str, failures: pytest.LogCaptureFixture
) -> None:
    async with stopline.open(f"sqlite:///{tmp_path / 'untraced.db'}") as plain:
        _, _, untraced = await _cut_and_settled(plain)
    raising = Raising(when, prefix)
    otel = Otel(raising)
    try:
        async with stopline.open(ledger_url, observers=[otel.telemetry]) as ledger:
            held, receipt, settled = await _cut_and_settled(ledger)
    finally:
        otel.shutdown()
    assert raising.raised >= 1
    assert held.interrupted.is_set()  # the cancel reached the call
    assert receipt.cancelled_by == "u"  # and returned its receipt
    # the run settled as one without telemetry does
    assert (settled.run_state, settled.headline) == (untraced.run_state, untraced.headline)
    assert [line.status for line in settled.lines] == [line.status for line in untraced.lines]
    # the run's span still ended with its headline (it is not the one that raised)
    [run_span] = [s for s in otel.spans.get_finished_spans() if s.name.startswith("stopline.r")]
    assert (run_span.attributes or {})["stopline.headline"] == settled.headline.value
    assert any(prefix in message for message in _logged(failures))


async def test_a_close_with_spans_open_closes_the_ledger_when_a_processor_raises(
    ledger_url: str, failures: pytest.LogCaptureFixture
) -> None:
    """The spans still open at close end as ``unfinished``; each end that raises is
    logged, and the backend is closed all the same (a second ledger then writes)."""
    raising = Raising("end", "stopline.run")
    otel = Otel(raising)
    try:
        async with stopline.open(ledger_url, observers=[otel.telemetry]) as ledger:
            await ledger.backend.create_run(
                RunSpec(id="run-left", name="left", owner="user:1", tenant="")
            )
            await ledger.backend.create_run(
                RunSpec(id="run-open", name="open", owner="user:1", tenant="")
            )
        async with stopline.open(ledger_url) as again:
            async with again.run("next", owner="user:1") as run:
                pass
            assert (await again.receipt(run.id)).headline is Headline.COMPLETED
    finally:
        otel.shutdown()
    assert raising.raised == 2  # both run spans ended, each raising
    assert len(_logged(failures)) == 2


async def test_a_raising_metric_hook_fails_no_call(
    ledger_url: str, failures: pytest.LogCaptureFixture
) -> None:
    """The SDK runs the exemplar filter inline on every measurement."""
    otel = Otel(meter=True)
    send = FakeProvider("send")
    try:
        async with stopline.open(ledger_url, observers=[otel.telemetry]) as ledger:
            async with ledger.run("job", owner="user:1") as run:
                await run.call(send.tool, "hello")
            receipt = await ledger.receipt(run.id)
    finally:
        otel.shutdown()
    assert len(send.requests) == 1
    assert receipt.headline is Headline.COMPLETED
    assert any("stopline.gate.decisions" in m for m in _logged(failures))
    assert any(name.startswith("stopline.run") for name in otel.names())  # spans unharmed


async def test_the_cancel_span_carries_the_reason_the_ledger_recorded(ledger_url: str) -> None:
    """A reason the ledger cannot store as given (a NUL byte, a lone surrogate, past
    ``MAX_REASON_CHARS``) is stored sanitised; the cancel span said the raw text (a
    lone surrogate no OTLP encoder can write), not what the ledger holds."""
    otel = Otel()
    reason = "stop\x00now \ud800 " + "x" * 5000
    try:
        async with stopline.open(ledger_url, observers=[otel.telemetry]) as ledger:
            async with ledger.run("job", owner="user:1") as run:
                await ledger.cancel(run.id, by="user:1", reason=reason)
            recorded = await ledger.backend.get_run(run.id)
    finally:
        otel.shutdown()
    [span] = [s for s in otel.spans.get_finished_spans() if s.name == "stopline.cancel"]
    assert recorded.cancel_reason is not None and recorded.cancel_reason != reason
    assert (span.attributes or {})["stopline.reason"] == recorded.cancel_reason
