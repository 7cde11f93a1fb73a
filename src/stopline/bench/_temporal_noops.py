"""The Temporal side of the peer bench: a workflow of sequential no-op activities.

Its own module: Temporal refuses workflow classes defined inside functions,
and importing it needs ``temporalio`` (the ``bench-peers`` extra).
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import activity, workflow

__all__ = ["Noops", "noop"]


@activity.defn(name="stopline_bench_noop")
async def noop(i: int) -> int:
    return i


@workflow.defn(name="StoplineBenchNoops", sandboxed=False)
class Noops:
    @workflow.run
    async def run(self, count: int) -> int:
        for i in range(count):
            await workflow.execute_activity(noop, i, start_to_close_timeout=timedelta(seconds=60))
        return count
