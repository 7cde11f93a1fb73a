"""Side effects for the framework tests, with their own ground truth.

``SyncEffect`` is the peers probe's "sync tool with a 2 s effect", with the
two seconds replaced by a barrier: when held, the function stops in its
worker thread until the test releases it, so a cancel lands while it runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio

import stopline

BARRIER_LIMIT = 20.0  # a safety net for a broken test, never a synchronisation


class SyncEffect:
    """A blocking side effect: records what it really did in ``effects``."""

    def __init__(self, name: str, *, hold: bool = False) -> None:
        self.name = name
        self.hold = hold
        self.reached = threading.Event()
        self.release = threading.Event()
        self.effects: list[Any] = []

    def __call__(self, payload: Any) -> str:
        if self.hold:
            self.reached.set()
            self.release.wait(BARRIER_LIMIT)
        self.effects.append(payload)
        return f"{self.name}:{payload}"

    async def wait_reached(self) -> None:
        """Until the function is running in its thread (the event loop stays free)."""
        await anyio.to_thread.run_sync(self.reached.wait, BARRIER_LIMIT)

    @contextmanager
    def released_at_exit(self) -> Iterator[SyncEffect]:
        """Never leave a worker thread parked, whatever the test does."""
        try:
            yield self
        finally:
            self.release.set()


class AsyncEffect:
    """A non-blocking side effect with its ground truth, readable back by key."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.effects: list[Any] = []

    async def __call__(self, payload: Any) -> str:
        self.effects.append(payload)
        return f"{self.name}:{payload}"


async def until_unknown(ledger: stopline.Ledger, op_id: str) -> None:
    """Until the framework's cancel has reached the call: its wait aborted, outcome unknown.

    Releasing a held thread before that would let its answer win the race with the
    cancel (a plain, on-time commit): true, but not the case under test.
    """
    while True:
        try:
            op = await ledger.backend.get_operation(op_id)
        except stopline.NotFound:
            op = None
        if op is not None and op.status is stopline.OpStatus.UNKNOWN:
            return
        await ledger.wait_for_change(op_id.partition("/")[0])
