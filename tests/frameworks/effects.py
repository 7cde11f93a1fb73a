"""Side effects for the framework tests, with their own ground truth.

``SyncEffect`` is the peers probe's "sync tool with a 2 s effect", with the
two seconds replaced by a barrier: when held, the function stops in its
worker thread until the test releases it, so a cancel lands while it runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
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


class FileEffect:
    """A side effect whose ground truth is a file: each call appends one line.

    ``hold`` parks the call before it writes, until the test releases it: for
    a ``def`` tool in its worker thread (``threading.Event``), for an async one
    on the event loop (``anyio.Event``). ``lines()`` is what really happened.
    """

    def __init__(self, path: Path, *, hold: bool = False) -> None:
        self.path = path
        self.hold = hold
        self.reached = threading.Event()
        self.release = threading.Event()
        self.async_reached = anyio.Event()
        self.async_release = anyio.Event()
        path.touch()

    def lines(self) -> list[str]:
        return self.path.read_text().splitlines()

    def write(self, line: str) -> str:
        """The plain-def body: blocks its thread at the barrier, then appends."""
        if self.hold:
            self.reached.set()
            self.release.wait(BARRIER_LIMIT)
        with self.path.open("a") as f:
            f.write(line + "\n")
        return f"wrote {line}"

    async def awrite(self, line: str) -> str:
        """The async body: waits at the barrier (a cancel interrupts it), then appends."""
        if self.hold:
            self.async_reached.set()
            await self.async_release.wait()
        with self.path.open("a") as f:
            f.write(line + "\n")
        return f"wrote {line}"

    async def wait_reached(self) -> None:
        """Until the def body is at the barrier in its thread (the event loop stays free)."""
        await anyio.to_thread.run_sync(self.reached.wait, BARRIER_LIMIT)

    def read_back(self) -> stopline.Verifier:
        """A verifier for a test's one effect: the file has its line, or provably not.

        Sound once the call can no longer write (its async body was cancelled)."""

        async def verify(ctx: stopline.CallContext) -> stopline.ReadBack:
            verdict = stopline.Verdict.COMMITTED if self.lines() else stopline.Verdict.NOT_COMMITTED
            return stopline.ReadBack(verdict, f"file:{self.path.name}", "read back")

        return verify

    def __enter__(self) -> FileEffect:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()  # never leave a worker thread parked
        self.async_release.set()


async def statuses(ledger: stopline.Ledger, run_id: str) -> dict[str, stopline.OpStatus]:
    """The run's operations' statuses by key (the run id taken off)."""
    ops = await ledger.backend.operations(run_id)
    return {op.id.removeprefix(f"{run_id}/"): op.status for op in ops}
