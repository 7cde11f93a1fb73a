"""A process whose global tracer provider has a span processor that raises at every
``stopline.background`` span, and whose background work fails (a write another process
holds a lock against): ``python -m tests.faults.background_span_agent DIR`` prints what
its runs ended as, one JSON line. The global provider can be set once per process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Span, SpanProcessor, TracerProvider

import stopline
from tests.faults.test_background import held_outcome_beside_a_run


class Raising(SpanProcessor):
    def __init__(self) -> None:
        self.raised = 0

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if span.name == "stopline.background":
            self.raised += 1
            raise RuntimeError("a span processor broke")


async def main(tmp: Path) -> dict[str, object]:
    raising = Raising()
    provider = TracerProvider()
    provider.add_span_processor(raising)
    trace.set_tracer_provider(provider)
    path = tmp / "ledger.db"
    async with stopline.open(f"sqlite:///{path}?busy_timeout=0.05") as ledger:

        async def failing() -> None:  # a background step failed: its span was started
            while not ledger.health.failures:
                await ledger.health.changed()

        a, b = await held_outcome_beside_a_run(ledger, path, failing)
        failures = ledger.health.failures
    return {
        "a": a.run_state.value,
        "a_lines": [line.status.value for line in a.lines],
        "b": b.run_state.value,
        "b_lines": [line.status.value for line in b.lines],
        "failures": failures,
        "raised": raising.raised,
    }


if __name__ == "__main__":
    print(json.dumps(anyio.run(main, Path(sys.argv[1]))), flush=True)
