"""The error boundary around background work: it never cancels a run.

Everything the ledger does behind the workflows' backs (lease renewal and
the sweep for dead workers, asking providers to cancel, verifying unknown
outcomes, settling cancelled runs, recording held outcomes) runs through
``Boundary.run``. A failure there is counted, logged and traced; a storage
or transport failure is retried with capped exponential backoff and jitter
for as long as the ledger is open; any other failure (a bug) ends that step
only. Nothing escapes into the ledger's task group, whose failure would
cancel every workflow in the process (ADR 0011).

``Health`` is what the boundary saw: ``degraded`` while any step is failing,
and for good once one stopped at an error no wait can clear (``broken``: the
ledger corrupt, its tables gone), shown by ``ledger.health``, the console and
``stopline stats`` (through the lease renewals a degraded worker misses).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import anyio
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from stopline.errors import (
    LedgerCorrupt,
    LedgerError,
    LedgerRefused,
    RunFenced,
    SchemaTooNew,
    StoplineError,
    describe,
)

__all__ = [
    "Backoff",
    "Boundary",
    "Health",
    "StepHealth",
    "only_cancels_of",
    "quietly",
    "retryable",
    "span_quietly",
    "typed",
]

log = logging.getLogger("stopline.background")
_tracer = trace.get_tracer("stopline")


@contextlib.contextmanager
def quietly(what: str, logger: logging.Logger) -> Iterator[None]:
    """An observer's code run inline (an OpenTelemetry SDK runs its span processors and
    exemplar filters so) that raises: logged on ``logger``, never raised into the work
    it observes (ADR 0077). Telemetry never fails what it observes."""
    try:
        yield
    except Exception:
        logger.warning("%s raised; the work it observes goes on", what, exc_info=True)


@contextlib.contextmanager
def span_quietly(
    tracer: trace.Tracer, name: str, logger: logging.Logger, **options: Any
) -> Iterator[trace.Span]:
    """``tracer.start_as_current_span(name, **options)`` around the block, its start and
    its end ``quietly``: the block's own errors go on up as they are."""
    manager = tracer.start_as_current_span(name, **options)
    span: trace.Span | None = None
    with quietly(f"starting span {name!r}", logger):
        span = manager.__enter__()
    if span is None:
        yield trace.INVALID_SPAN
        return
    try:
        yield span
    except BaseException as exc:
        with quietly(f"ending span {name!r}", logger):
            manager.__exit__(type(exc), exc, exc.__traceback__)
        raise
    with quietly(f"ending span {name!r}", logger):
        manager.__exit__(None, None, None)


@dataclasses.dataclass(frozen=True, slots=True)
class Backoff:
    """Capped exponential backoff with jitter (each delay drawn in [d*(1-jitter), d])."""

    first: float = 0.05
    factor: float = 2.0
    cap: float = 5.0
    jitter: float = 0.5

    def delays(self) -> Iterator[float]:
        delay = self.first
        while True:
            yield delay * (1 - self.jitter * random.random())
            delay = min(delay * self.factor, self.cap)


def retryable(exc: BaseException) -> bool:
    """A fault that may clear by itself: storage or transport, not a bug, a bad file or a
    write the ledger refuses for good."""
    if isinstance(exc, (SchemaTooNew, LedgerCorrupt, LedgerRefused)):
        return False
    return isinstance(exc, (LedgerError, OSError, TimeoutError))


@dataclasses.dataclass(slots=True)
class StepHealth:
    failures: int = 0
    retries: int = 0
    last_error: str = ""
    last_failure_at: float | None = None
    failing: int = 0  # steps of this kind failing now (retrying until the fault clears)

    def to_json(self) -> dict[str, Any]:
        return {
            "failures": self.failures,
            "retries": self.retries,
            "failing": self.failing,
            "last_error": self.last_error,
            "last_failure_at": self.last_failure_at,
        }


class Health:
    """Counts per kind of background step."""

    def __init__(self) -> None:
        self.steps: dict[str, StepHealth] = {}
        # the error a step stopped at that no wait can clear (the ledger corrupt, its
        # tables gone, written by a newer stopline): degraded from then on
        self.broken = ""
        self._changed = anyio.Event()

    async def changed(self) -> None:
        """Until the next failure or recovery (a barrier for tests and dashboards)."""
        await self._changed.wait()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    @property
    def degraded(self) -> bool:
        return bool(self.broken) or any(s.failing for s in self.steps.values())

    @property
    def failures(self) -> int:
        return sum(s.failures for s in self.steps.values())

    def failed(self, step: str, exc: BaseException, *, retrying: bool) -> None:
        health = self.steps.setdefault(step, StepHealth())
        health.failures += 1
        health.retries += retrying
        health.last_error = describe(exc)
        health.last_failure_at = time.time()
        if isinstance(exc, (SchemaTooNew, LedgerCorrupt)):
            self.broken = health.last_error
        level = logging.WARNING if retrying else logging.ERROR
        log.log(level, "background step %s failed (%s)%s", step, health.last_error,
                "; retrying" if retrying else "", exc_info=not retrying)  # fmt: skip
        # a span processor that raised here escaped the boundary into the ledger's task
        # group, which cancelled every run of the process
        with (
            quietly("the stopline.background span", log),
            _tracer.start_as_current_span("stopline.background") as span,
        ):
            span.set_attribute("stopline.step", step)
            span.set_attribute("stopline.retrying", retrying)
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, health.last_error))
        self._signal()

    def failing(self, step: str, now: bool) -> None:
        """One step of this kind starts (or stops) failing."""
        health = self.steps.setdefault(step, StepHealth())
        health.failing += 1 if now else -1
        if not now:
            log.info("background step %s recovered", step)
        self._signal()

    def to_json(self) -> dict[str, Any]:
        return {
            "degraded": self.degraded,
            "broken": self.broken,
            "failures": self.failures,
            "steps": {name: s.to_json() for name, s in sorted(self.steps.items())},
        }


class Boundary:
    """Runs background steps so that their failures stay theirs."""

    def __init__(self, health: Health, backoff: Backoff | None = None) -> None:
        self.health = health
        self.backoff = backoff or Backoff()

    async def run(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        step = getattr(fn, "__name__", type(fn).__name__).lstrip("_")
        delays = self.backoff.delays()
        failing = False
        try:
            while True:
                try:
                    await fn(*args)
                    return
                except Exception as exc:
                    again = retryable(exc)
                    self.health.failed(step, exc, retrying=again)
                    if not again:
                        return
                    if not failing:
                        failing = True
                        self.health.failing(step, True)
                await anyio.sleep(next(delays))
        finally:
            if failing:
                self.health.failing(step, False)


def typed(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first typed error in a group of background failures (the boundary lets none
    through; this is the last line), else the group itself."""
    for leaf in _leaves(group):
        if isinstance(leaf, StoplineError):
            return leaf
    return group


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def only_cancels_of(exc: BaseException | None, run_id: str) -> bool:
    """``RunFenced`` of this run, alone or as every leaf of an exception group."""
    if isinstance(exc, RunFenced):
        return exc.run_id == run_id
    if isinstance(exc, BaseExceptionGroup):
        cancel_class = anyio.get_cancelled_exc_class()
        leaves = exc.exceptions
        return all(only_cancels_of(e, run_id) or isinstance(e, cancel_class) for e in leaves) and (
            any(only_cancels_of(e, run_id) for e in leaves)
        )
    return False
