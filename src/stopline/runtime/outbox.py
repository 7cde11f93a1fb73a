"""Outcomes the ledger could not take yet: held in order and retried until it does.

A call whose provider answered has an outcome worth keeping even when the
ledger cannot write for a moment (a full disk, a database restart): the
workflow gets its answer, and the outcome waits here, in order per
operation, retried behind the error boundary with backoff until the ledger
takes it. Meanwhile the operation is ``requested`` in the ledger, so its
run cannot settle and its receipt says the outcome is still recording. If
the process dies first, the operation is left to crash recovery, which
marks it ``unknown`` and reads the destination back (R2, R5).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import anyio

from stopline.errors import StoplineError
from stopline.ledger.backend import OutcomeUpdate
from stopline.runtime.boundary import retryable

if TYPE_CHECKING:
    from stopline.runtime.core import Core
    from stopline.runtime.run import Run

__all__ = ["Outbox"]


class Outbox:
    def __init__(self, core: Core) -> None:
        self._core = core
        self.held: dict[str, list[OutcomeUpdate]] = {}  # op id -> outcomes in order

    async def record(self, op_id: str, update: OutcomeUpdate) -> None:
        """Record the outcome now, or hold it if the ledger cannot take it yet."""
        queue = self.held.get(op_id)
        if queue is not None:  # an earlier outcome of this operation waits: keep the order
            queue.append(update)
            return
        try:
            await self._core.outcomes.resolve(op_id, update)
        except Exception as exc:
            if not retryable(exc):
                raise
            self.held[op_id] = [update]
            self._core.spawn(self.drain, op_id)

    async def drain(self, op_id: str) -> None:
        """Write what is held for one operation, in order (the boundary retries a failure)."""
        queue = self.held.get(op_id, [])
        while queue:
            await self._core.outcomes.resolve(op_id, queue[0])
            queue.pop(0)
        self.held.pop(op_id, None)

    async def end_run(self, run: Run, error: BaseException | None) -> None:
        """A run block ends: record how (or settle it, if it was cancelled). If the ledger
        cannot take it, the end is held and retried. A cancelled run's settlement is
        background work; for a run that ended by itself the block's own error, if any,
        goes on (never hidden behind the ledger's), else its caller gets the typed error."""
        core = self._core
        # cancelled: it settles; suspended (waiting for a person): it stays paused
        settles = run.cancel_requested or (run.suspended and error is None)
        try:
            if settles:
                core.changed(run.id)
                await core.settler.advance(run.id)
            else:
                await core.outcomes.end(run.id, by=run.owner, error=error)
        except Exception as failed:
            if not retryable(failed):
                raise
            if settles:
                core.spawn(core.settler.advance, run.id)
                return
            core.spawn(core.outcomes.end, run.id, run.owner, error)
            if error is None:
                raise

    async def flush(self, timeout: float = 2.0) -> None:
        """On close: one last try for what is held; what stays is left to recovery."""
        with anyio.move_on_after(timeout):
            for op_id in list(self.held):
                with contextlib.suppress(StoplineError, OSError):
                    await self.drain(op_id)
