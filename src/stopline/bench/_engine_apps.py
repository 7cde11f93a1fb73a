"""The workflows ``stopline bench`` measures on Temporal and DBOS (module level: Temporal
wants workflow classes importable by name, DBOS registers its functions at import)."""

from __future__ import annotations

from datetime import timedelta

from dbos import DBOS
from temporalio import activity, workflow

from stopline.integrations.dbos import StoplineDBOS

__all__ = ["Activities", "bare_steps", "gate", "gated_steps", "noop"]


@activity.defn(name="bench_noop")
async def noop(n: int) -> int:
    return n


@workflow.defn(name="BenchActivities", sandboxed=False)
class Activities:
    @workflow.run
    async def run(self, count: int) -> None:
        for n in range(count):
            await workflow.execute_activity(noop, n, start_to_close_timeout=timedelta(seconds=30))


gate = StoplineDBOS(owner="bench")


@DBOS.step()
async def bare_step(n: int) -> int:
    return n


@DBOS.step()
@gate.step(name="bench_step")
async def gated_step(n: int) -> int:
    return n


@DBOS.workflow()
async def bare_steps(count: int) -> None:
    for n in range(count):
        await bare_step(n)


@DBOS.workflow()
@gate.workflow()
async def gated_steps(count: int) -> None:
    for n in range(count):
        await gated_step(n)
