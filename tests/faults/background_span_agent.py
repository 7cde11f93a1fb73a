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
from stopline import Cancellable, Policy
from stopline.testing import FakeProvider
from tests.faults.test_background import write_locked


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
    slow = FakeProvider("slow", cancellable=Cancellable.NEVER)
    other = FakeProvider("other")
    responding = slow.hold("responding")
    fault_cleared = anyio.Event()
    async with stopline.open(f"sqlite:///{path}?busy_timeout=0.05") as ledger:

        async def run_a() -> None:
            async with ledger.run("a", owner="u", run_id="run_a", policy=Policy.AT_BOUNDARY) as a:
                await a.call(slow.tool, "x", key="x")
                a.boundary()

        async def run_b() -> None:
            async with ledger.run("b", owner="u", run_id="run_b") as b:
                await b.call(other.tool, "1", key="1")
                await fault_cleared.wait()  # untouched by the fault, its span and a's cancel
                await b.call(other.tool, "2", key="2")

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_a)
            tg.start_soon(run_b)
            await responding.reached.wait()
            await ledger.cancel("run_a", by="u")
            with write_locked(path):
                responding.release()  # the outcome cannot be written: a step fails
                while not ledger.health.failures:
                    await ledger.health.changed()
            fault_cleared.set()
        a = await ledger.wait_settled("run_a", timeout=30)
        b = await ledger.wait_settled("run_b", timeout=30)
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
