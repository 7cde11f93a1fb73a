"""Small workflows the scenario tests drive, and a harness to start them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

import stopline
from stopline import PhaseKind, Policy
from stopline.testing import FakeProvider


class Started:
    """A workflow started in a task group, with its run id once known."""

    def __init__(self) -> None:
        self.run_id = ""
        self.ready = anyio.Event()
        self.done = anyio.Event()
        self.entries = 0  # how many times the workflow body began (R4: never restarted)
        self.results: list[Any] = []
        self.error: BaseException | None = None


def start(
    tg: TaskGroup,
    ledger: stopline.Ledger,
    body: Callable[[stopline.Run, Started], Awaitable[None]],
    *,
    name: str = "job",
    owner: str = "user:1",
) -> Started:
    started = Started()

    async def main() -> None:
        try:
            async with ledger.run(name, owner=owner) as run:
                started.run_id = run.id
                started.entries += 1
                started.ready.set()
                await body(run, started)
        except Exception as exc:
            started.error = exc
        finally:
            started.ready.set()
            started.done.set()

    tg.start_soon(main)
    return started


def calls(
    *providers: FakeProvider, policy: Policy | None = None
) -> Callable[[stopline.Run, Started], Awaitable[None]]:
    """A body that calls each provider in turn (in a calling_external phase)."""

    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, policy):
            for provider in providers:
                started.results.append(await run.call(provider.tool, provider.name))

    return body
