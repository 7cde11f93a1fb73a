"""OpenTelemetry traces and metrics, observed from the ledger's durable writes.

    async with stopline.open(url, observers=[Telemetry()]) as ledger:
        ...

``Telemetry`` wraps the ledger's backend (the storage seam) and turns every write that
reached the ledger into spans and metrics: a trace never shows more than the ledger
proves. Only ``opentelemetry-api`` is needed (no SDK: no-ops). Spans, attributes and
metrics (``stopline stats``'s figures): docs/telemetry.md; an operation's first resolved
outcome carries a ``span`` evidence pointer ``<trace_id>:<span_id>``. A span processor
or metric hook that raises (the SDK runs them inline) is logged: the write stands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from time import time_ns
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN_CONTEXT as NO_SPAN
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode

from stopline.domain.lifecycle import CancelResult
from stopline.domain.limits import sanitise
from stopline.domain.model import Evidence, OperationRecord, OperationSpec, RunRecord
from stopline.domain.receipt import headline_for
from stopline.domain.vocab import (
    EvidenceKind,
    OpEvent,
    OpStatus,
    PhaseKind,
    Policy,
    RunEvent,
    RunState,
)
from stopline.errors import IllegalTransition, UnknownOperation, UnknownRun
from stopline.ledger.backend import Backend, GateResult, GateVerdict, Note, OutcomeUpdate, RunSpec
from stopline.ledger.forwarding import ForwardingBackend, seeing_the_commit
from stopline.runtime.boundary import quietly

__all__ = ["ATTR_OP_ID", "ATTR_RUN_ID", "ATTR_STATUS", "Telemetry", "TracedBackend"]

ATTR_RUN_ID = "stopline.run_id"
ATTR_OP_ID = "stopline.op_id"
ATTR_STATUS = "stopline.status"

_SETTLING_EVENTS = frozenset({RunEvent.SETTLED, RunEvent.ESCALATE})
_RUN_END_EVENTS = _SETTLING_EVENTS | {RunEvent.COMPLETE, RunEvent.FAIL}
# events whose run and tree are read before the write (its headline): ends, reviews
_HEADLINE_EVENTS = _RUN_END_EVENTS | {RunEvent.REVIEWED}
_RESOLVED_BY = {
    OpEvent.VERIFIED_COMMITTED: "read_back",
    OpEvent.VERIFIED_NOT_COMMITTED: "read_back",
    OpEvent.REVIEWED_COMMITTED: "review",
    OpEvent.REVIEWED_NOT_COMMITTED: "review",
    OpEvent.CANCEL_CONFIRMED: "provider",
}
_TROUBLE = frozenset({OpStatus.NEEDS_REVIEW, OpStatus.COMPENSATION_FAILED})
_Read = tuple[RunRecord, list[OperationRecord]]  # a run and its tree's operations
_log = logging.getLogger(__name__)


def _finish(span: Span, end_time: int | None = None) -> None:
    with quietly(f"ending span {getattr(span, 'name', '')!r}", _log):
        span.end(end_time=end_time)


def _may_change(run: RunRecord, ops: Sequence[OperationRecord]) -> bool:
    """Whether an ended run's headline can still change: in review, or a call unsettled."""
    return run.state is RunState.NEEDS_REVIEW or not all(op.status.settled for op in ops)


def resolved_by(event: OpEvent) -> str:
    """How an unknown outcome was settled: the ``stats`` categories."""
    return _RESOLVED_BY.get(event, "late_response")


class Telemetry:
    """An observer for ``stopline.open(url, observers=[Telemetry()])``; providers default
    to the globally configured ones (no-ops without an SDK)."""

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        from stopline import __version__

        self.tracer = trace.get_tracer("stopline", __version__, tracer_provider)
        meter = metrics.get_meter("stopline", __version__, meter_provider=meter_provider)
        self.outcomes = meter.create_counter(
            "stopline.runs.outcomes", description="Runs settled or ended, by receipt headline"
        )
        self.settle_time = meter.create_histogram(
            "stopline.cancel.settle_time",
            unit="s",
            description="Time from the cancel (fence) to the settled receipt",
        )
        self.unknowns = meter.create_counter(
            "stopline.unknowns.resolved",
            description="Unknown outcomes resolved, by read_back, review, late_response, provider",
        )
        self.gate_decisions = meter.create_counter(
            "stopline.gate.decisions", description="Dispatch gate verdicts"
        )
        self.op_outcomes = meter.create_counter(
            "stopline.operations.outcomes", description="Resolved operation statuses"
        )
        self.revised = meter.create_counter(
            "stopline.runs.revised",
            description="Ended runs whose headline changed since (review, read-back, ...)",
        )
        self.reopened = meter.create_counter(
            "stopline.runs.reopened", description="Settled cancels that later evidence reopened"
        )
        # spans in progress, shared by every ledger this observer watches in the process
        self.open_backends = 0
        self.runs: dict[str, Span] = {}
        self.phases: dict[str, Span] = {}
        self.ops: dict[str, Span] = {}
        self.verifying: dict[str, Span] = {}
        self.compensating: dict[str, Span] = {}
        self.cancels: dict[str, Context] = {}
        self.doubted: set[str] = set()  # operations that were unknown at some point
        self.linked: set[str] = set()  # operations whose outcome carries a span pointer
        # runs whose span ended while their headline could still change (an operation
        # unsettled, the run in review): their span and headline then, to follow them
        self.open_outcomes: dict[str, tuple[SpanContext, str]] = {}

    def __call__(self, backend: Backend) -> Backend:
        self.open_backends += 1
        return TracedBackend(backend, self)


class TracedBackend(ForwardingBackend):
    """Forwards every call unchanged; records spans and metrics of what was written."""

    def __init__(self, inner: Backend, telemetry: Telemetry) -> None:
        super().__init__(inner)
        self._t = telemetry
        self._runs = telemetry.runs
        self._ops = telemetry.ops
        self._verify = telemetry.verifying
        self._compensate = telemetry.compensating
        self._open_outcomes = telemetry.open_outcomes

    # -- helpers -------------------------------------------------------------------
    def _under_run(self, run_id: str) -> Context | None:
        span = self._runs.get(run_id)
        return trace.set_span_in_context(span) if span is not None else None

    def _op_span(self, op_id: str, run_id: str, tool: str) -> Span:
        span = self._ops.get(op_id)
        if span is None:
            span = self._ops[op_id] = self._start(
                f"stopline.operation {tool}",
                context=self._under_run(run_id),
                kind=SpanKind.CLIENT,
                attributes={ATTR_RUN_ID: run_id, ATTR_OP_ID: op_id, "stopline.tool": tool},
            )
        return span

    def _child(self, name: str, parent: Span, attributes: dict[str, Any]) -> Span:
        return self._start(name, trace.set_span_in_context(parent), attributes=attributes)

    def _start(self, name: str, context: Context | None = None, **options: Any) -> Span:
        """A span started, or a non-recording one if starting it raised."""
        with quietly(f"starting span {name!r}", _log):
            return self._t.tracer.start_span(name, context=context, **options)
        return trace.INVALID_SPAN

    @staticmethod
    def _measure(record: Callable[[float, dict[str, str]], None], value: float, **by: str) -> None:
        """One measurement (``add`` or ``record``), its attributes ``stopline.<key>``."""
        with quietly(f"measuring {getattr(getattr(record, '__self__', None), 'name', '')}", _log):
            record(value, {f"stopline.{key}": v for key, v in by.items()})

    @staticmethod
    def _end(
        span: Span | None, status: str, *, end_time: int | None = None, **attributes: Any
    ) -> None:
        if span is None:
            return
        span.set_attribute(ATTR_STATUS, status)
        for key, value in attributes.items():
            span.set_attribute(f"stopline.{key}", value)
        if status in _TROUBLE:
            span.set_status(Status(StatusCode.ERROR, status))
        _finish(span, end_time)

    @contextlib.contextmanager
    def _errors_on(self, span: Span) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            _finish(span)  # the backend's own error is the one raised
            raise

    # -- runs ----------------------------------------------------------------------
    async def create_run(self, spec: RunSpec) -> RunRecord:
        run = await self.inner.create_run(spec)
        self._runs[run.id] = self._start(
            f"stopline.run {run.name}",
            attributes={
                ATTR_RUN_ID: run.id,
                "stopline.owner": run.owner,
                "stopline.tenant": run.tenant,
                "stopline.parent_id": run.parent_id or "",
                ATTR_STATUS: run.state.value,
            },
        )
        return run

    async def run_event(
        self, run_id: str, event: RunEvent, *, by: str, reason: str = ""
    ) -> tuple[RunRecord, bool]:
        if event is not RunEvent.CANCEL:
            # read before the write, so the spans end with no await after the commit; the
            # tree's operations, as the run's receipt reads them (its headline is theirs)
            ending = event in _HEADLINE_EVENTS
            read = await self.inner.run_and_operations(run_id, descendants=True) if ending else None
            run, changed = await self.inner.run_event(run_id, event, by=by, reason=reason)
            if changed:
                self._run_changed(run, event, read)
            return run, changed
        result = await self.cancel(run_id, by=by, reason=reason)
        return result.run, result.first

    async def run_events(
        self, items: Sequence[tuple[str, RunEvent]], *, by: str
    ) -> list[tuple[RunRecord, bool] | IllegalTransition | UnknownRun]:
        # as ``run_event``: the ending runs' operations read before the write, in one read
        ending = [run_id for run_id, event in items if event in _HEADLINE_EVENTS]
        read: dict[str, _Read] = {}
        for found in await self.inner.trees_and_operations(ending) if ending else []:
            if not isinstance(found, UnknownRun):
                read[found[0].id] = found
        results = await self.inner.run_events(items, by=by)
        for (run_id, event), result in zip(items, results, strict=True):
            if isinstance(result, tuple) and result[1]:
                self._run_changed(result[0], event, read.get(run_id))
        return results

    async def cancel(self, run_id: str, *, by: str, reason: str = "") -> CancelResult:
        said = sanitise(reason)  # the reason as the ledger stores it (the fence's write)
        span = self._start(
            "stopline.cancel",
            attributes={ATTR_RUN_ID: run_id, "stopline.by": by, "stopline.reason": said},
            links=[trace.Link(s.get_span_context()) for s in [self._runs.get(run_id)] if s],
        )
        committed: list[int] = []  # the span ends at the fence's commit (ADR 0043)
        with self._errors_on(span), seeing_the_commit(lambda _: committed.append(time_ns())):
            result = await self.inner.cancel(run_id, by=by, reason=reason)
        run = result.run
        span.set_attribute("stopline.first", result.first)  # R7: a second cancel changes nothing
        span.set_attribute("stopline.fence", run.fence)
        span.set_attribute("stopline.fenced_runs", len(result.fenced))  # the owned subtree
        if result.first:
            context = trace.set_span_in_context(span)
            for fenced in result.fenced:
                self._t.cancels[fenced] = context
                run_span = self._runs.get(fenced)
                if run_span is not None:
                    run_span.add_event("stopline.cancel", {"stopline.by": by})
        self._end(span, run.state.value, end_time=committed[0] if committed else None)
        return result

    def _run_changed(self, run: RunRecord, event: RunEvent, read: _Read | None) -> None:
        """``read``: the run and its tree's operations before the move. A run's end counts
        once: a settled cancel sent back to review (ADR 0093) is reopened, not ended."""
        before, ops = read or (None, [])
        run_span = self._runs.get(run.id)
        if run_span is not None:
            run_span.add_event(f"stopline.{event.value}", {ATTR_STATUS: run.state.value})
        reopened = event is RunEvent.ESCALATE and before is not None and before.state.ended
        if event is RunEvent.REVIEWED or reopened:
            self._revise(run, ops)
        if reopened:
            self._measure(self._t.reopened.add, 1)
        if event not in _RUN_END_EVENTS or reopened:
            return
        headline = headline_for(run, ops).value
        if run_span is not None and _may_change(run, ops):
            self._open_outcomes[run.id] = (run_span.get_span_context(), headline)
        self._measure(self._t.outcomes.add, 1, headline=headline)
        cancel = self._t.cancels.pop(run.id, None)
        if event in _SETTLING_EVENTS and run.cancelled_at is not None:
            waited = max(0.0, run.updated_at - run.cancelled_at)
            self._measure(self._t.settle_time.record, waited, headline=headline)
            settle = self._start(
                "stopline.settle", context=cancel, attributes={ATTR_RUN_ID: run.id}
            )
            self._end(settle, run.state.value, headline=headline)
        self._end(self._t.phases.pop(run.id, None), run.state.value)
        self._end(self._runs.pop(run.id, None), run.state.value, headline=headline)

    def _revise(self, run: RunRecord, ops: Sequence[OperationRecord]) -> None:
        """A run whose span ended with a headline that could still change: if it did, a
        ``stopline.outcome`` span under the run's says so (its span's was true then)."""
        if (ended := self._open_outcomes.get(run.id)) is None:
            return
        context, before = ended
        headline = headline_for(run, ops).value
        if not _may_change(run, ops):
            del self._open_outcomes[run.id]
        elif headline != before:
            self._open_outcomes[run.id] = (context, headline)
        if headline == before:
            return
        self._measure(self._t.revised.add, 1, headline=headline, previous=before)
        span = self._start(
            "stopline.outcome",
            context=trace.set_span_in_context(NonRecordingSpan(context)),
            attributes={ATTR_RUN_ID: run.id, "stopline.previous": before},
        )
        self._end(span, run.state.value, headline=headline)

    async def _follow_again(self, op_id: str) -> None:
        """Before a contradiction reopens a call: its run, ended and followed no more, is
        followed again from its headline, the last one counted (spans: a trace of their own)."""
        with contextlib.suppress(Exception):  # tracing never breaks an outcome
            op = await self.inner.get_operation(op_id)
            run, ops = await self.inner.run_and_operations(op.run_id, descendants=True)
            if run.state.ended and run.id not in self._open_outcomes:
                self._open_outcomes[run.id] = (NO_SPAN, headline_for(run, ops).value)

    async def _revise_after(self, ops: Sequence[OperationRecord]) -> None:
        """The headline of each ended run followed whose operation just changed, read
        again (after the write: no run event marks it). A failed read traces nothing."""
        for run_id in {op.run_id for op in ops if op.run_id in self._open_outcomes}:
            with contextlib.suppress(Exception):  # tracing never breaks an outcome
                self._revise(*await self.inner.run_and_operations(run_id, descendants=True))

    async def set_phase(self, run_id: str, kind: PhaseKind, policy: Policy) -> RunRecord:
        run = await self.inner.set_phase(run_id, kind, policy)
        self._end(self._t.phases.pop(run_id, None), "left")
        self._t.phases[run_id] = self._start(
            f"stopline.phase {kind.value}",
            context=self._under_run(run_id),
            attributes={ATTR_RUN_ID: run_id, "stopline.policy": policy.value},
        )
        return run

    # -- operations ------------------------------------------------------------------
    async def gate(self, spec: OperationSpec) -> GateResult:
        op_span = self._op_span(spec.id, spec.run_id, spec.tool)
        dispatch = self._child("stopline.dispatch", op_span, {ATTR_OP_ID: spec.id})
        with self._errors_on(dispatch):
            result = await self.inner.gate(spec)
        verdict = result.verdict.value
        self._measure(self._t.gate_decisions.add, 1, gate=verdict)
        dispatch.set_attribute("stopline.gate", verdict)
        dispatch.set_attribute("stopline.fence", result.fence)
        _finish(dispatch)
        if result.verdict is GateVerdict.PASSED:
            op_span.set_attribute(ATTR_STATUS, OpStatus.REQUESTED.value)
        elif result.verdict is GateVerdict.PREVENTED:
            self._measure(self._t.op_outcomes.add, 1, status=OpStatus.PREVENTED.value)
            self._end(self._ops.pop(spec.id, None), OpStatus.PREVENTED.value)
        else:  # paused (asked again later) or a replay of a recorded operation
            status = result.operation.status.value if result.operation else verdict
            self._end(self._ops.pop(spec.id, None), status, gate=verdict)
        return result

    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        update = self._with_span(op_id, update)
        if update.event is OpEvent.CONFLICT:  # written alone (Outcomes): it may reopen a run
            await self._follow_again(op_id)
        op = self._recorded(await self.inner.record(op_id, update), update)
        await self._revise_after([op])
        return op

    async def record_many(
        self, items: Sequence[tuple[str, OutcomeUpdate]]
    ) -> list[OperationRecord | IllegalTransition]:
        updates = [(op_id, self._with_span(op_id, update)) for op_id, update in items]
        results = await self.inner.record_many(updates)
        for (_op_id, update), result in zip(updates, results, strict=True):
            if not isinstance(result, IllegalTransition):
                self._recorded(result, update)
        await self._revise_after([r for r in results if not isinstance(r, IllegalTransition)])
        return results

    def record_deferred(
        self,
        op_id: str,
        update: OutcomeUpdate,
        then: Callable[[Callable[[], OperationRecord]], None],
    ) -> None:
        """Deferred as the backend defers it (ADR 0022); traced once it commits."""
        update = self._with_span(op_id, update)

        def traced(outcome: Callable[[], OperationRecord]) -> None:
            def observed() -> OperationRecord:
                op = outcome()  # raises what record would: the ledger's to handle
                with contextlib.suppress(Exception):  # tracing never breaks an outcome
                    self._recorded(op, update)
                return op

            then(observed)

        self.inner.record_deferred(op_id, update, traced)

    def _resolving(self, update: OutcomeUpdate) -> bool:
        return update.event not in (OpEvent.ACCEPTED, OpEvent.COMPENSATION_STARTED)

    def _with_span(self, op_id: str, update: OutcomeUpdate) -> OutcomeUpdate:
        """The outcome with a pointer to the operation's span among its evidence (once)."""
        span = self._ops.get(op_id)
        if span is None or not self._resolving(update) or op_id in self._t.linked:
            return update
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return update
        pointer = f"{trace.format_trace_id(ctx.trace_id)}:{trace.format_span_id(ctx.span_id)}"
        evidence = [Evidence(EvidenceKind.SPAN, pointer, "otel"), *update.evidence]
        return dataclasses.replace(update, evidence=evidence)

    def _recorded(self, op: OperationRecord, update: OutcomeUpdate) -> OperationRecord:
        if self._resolving(update):
            self._t.linked.add(op.id)
        self._op_changed(op, update.event, late=update.late)
        return op

    def _op_changed(self, op: OperationRecord, event: OpEvent, *, late: bool) -> None:
        span = self._op_span(op.id, op.run_id, op.tool)
        span.add_event(f"stopline.{event.value}", {ATTR_STATUS: op.status.value, "late": late})
        span.set_attribute(ATTR_STATUS, op.status.value)
        if op.status is OpStatus.UNKNOWN:
            self._t.doubted.add(op.id)
            if op.id not in self._verify:
                self._verify[op.id] = self._child(
                    "stopline.verify", span, {ATTR_RUN_ID: op.run_id, ATTR_OP_ID: op.id}
                )
        elif op.id in self._verify:
            self._end(self._verify.pop(op.id), op.status.value, event=event.value)
        if event is OpEvent.COMPENSATION_STARTED:
            self._compensate[op.id] = self._child(
                "stopline.compensate", span, {ATTR_RUN_ID: op.run_id, ATTR_OP_ID: op.id}
            )
        elif op.id in self._compensate and op.status is not OpStatus.COMPENSATING:
            self._end(self._compensate.pop(op.id), op.status.value)
        if op.id in self._t.doubted and op.status in (OpStatus.COMMITTED, OpStatus.NOT_COMMITTED):
            self._t.doubted.discard(op.id)
            self._measure(self._t.unknowns.add, 1, resolved_by=resolved_by(event))
        if op.status.resolved and op.status is not OpStatus.NEEDS_REVIEW:
            self._measure(self._t.op_outcomes.add, 1, status=op.status.value)
            self._end(self._ops.pop(op.id, None), op.status.value, late=late)
            self._t.linked.discard(op.id)  # per-operation state ends with the operation
        elif op.status is OpStatus.NEEDS_REVIEW:
            self._t.doubted.add(op.id)  # a reviewer (or late evidence) resolves it

    async def begin_compensation(
        self, spec: OperationSpec, evidence: Sequence[Evidence]
    ) -> GateResult:
        """A correction starts: the corrected operation's compensate span opens here."""
        result = await self.inner.begin_compensation(spec, evidence)
        if result.verdict is GateVerdict.PASSED and spec.compensates is not None:
            corrected = await self.inner.get_operation(spec.compensates)
            self._op_changed(corrected, OpEvent.COMPENSATION_STARTED, late=False)
        return result

    async def note(
        self, op_id: str, kind: str, data: dict[str, Any], cancel_state: str | None = None
    ) -> OperationRecord:
        op = await self.inner.note(op_id, kind, data, cancel_state)
        self._noted(op, kind)
        return op

    async def note_many(self, notes: Sequence[Note]) -> list[OperationRecord | UnknownOperation]:
        results = await self.inner.note_many(notes)
        for note, result in zip(notes, results, strict=True):
            if not isinstance(result, UnknownOperation):
                self._noted(result, note.kind)
        return results

    def _noted(self, op: OperationRecord, kind: str) -> None:
        target = self._ops.get(op.id) or self._runs.get(op.run_id)
        if target is not None:
            target.add_event(f"stopline.{kind}", {ATTR_OP_ID: op.id, ATTR_STATUS: op.status.value})

    async def close(self) -> None:
        """Spans still open end as ``unfinished``: the ledger keeps the truth for next time."""
        self._t.open_backends -= 1
        for spans in (self._verify, self._compensate, self._ops, self._t.phases, self._runs):
            if self._t.open_backends > 0:
                break  # another ledger of this process still writes these runs
            for span in spans.values():
                self._end(span, "unfinished")
            spans.clear()
        if self._t.open_backends == 0:
            self._open_outcomes.clear()
        await self.inner.close()
