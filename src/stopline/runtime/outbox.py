"""Outcomes the ledger could not take yet: held in order and retried until it does.

A call whose provider answered has an outcome worth keeping even when the
ledger cannot write for a moment (a full disk, a database restart): the
workflow gets its answer, and the outcome waits here, in order per
operation, retried behind the error boundary with backoff until the ledger
takes it. Meanwhile the operation is ``requested`` in the ledger, so its
run cannot settle and its receipt says the outcome is still recording. If
the process dies first, the operation is left to crash recovery, which
marks it ``unknown`` and reads the destination back (R2, R5).

An outcome the ledger refuses for ever is not retried for ever (ADR 0069):
one that meets an error no wait clears (a bug, an operation the ledger does
not hold), or an error the engine could not classify (a constraint of the
schema, an operator's trigger) ``UNCLASSIFIED_TRIES`` times in a row, is
recorded once as what it is and the queue moves on to the outcomes behind
it. A final answer the ledger refused becomes ``unknown`` with the answer's
evidence and the refusal (a read-back then proves what happened: R3, R5);
an acceptance is kept as evidence. A ledger that is broken (corrupt, too
new) is no refusal of one outcome: what is held stays for crash recovery.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import anyio

from stopline.domain.model import Evidence
from stopline.domain.vocab import Cause, OpEvent
from stopline.errors import LedgerError, LedgerRefused, StoplineError, describe
from stopline.ledger.backend import OutcomeUpdate
from stopline.runtime.boundary import retryable

if TYPE_CHECKING:
    from stopline.runtime.core import Core
    from stopline.runtime.run import Run

__all__ = ["UNCLASSIFIED_TRIES", "Outbox", "refused"]

log = logging.getLogger("stopline.background")

# tries of one held outcome that meet an error the engine could not classify (a plain
# ``LedgerError``) before it is taken as refused: about 1.5 s of the boundary's backoff
UNCLASSIFIED_TRIES = 6


def refused(exc: BaseException, tries: int) -> bool:
    """Whether the ledger refuses a write for ever: the engine says so (``LedgerRefused``),
    an error no wait clears other than the ledger's own being broken, or one the engine
    could not classify, met ``tries`` times (``UNCLASSIFIED_TRIES`` or more)."""
    if not retryable(exc):  # a LedgerError no wait clears (but a refusal): broken
        return not isinstance(exc, LedgerError) or isinstance(exc, LedgerRefused)
    return type(exc) is LedgerError and tries >= UNCLASSIFIED_TRIES


class Outbox:
    def __init__(self, core: Core) -> None:
        self._core = core
        self.held: dict[str, list[OutcomeUpdate]] = {}  # op id -> outcomes in order
        self._tries: dict[str, int] = {}  # op id -> failed tries of its first held outcome

    async def record(self, op_id: str, update: OutcomeUpdate) -> None:
        """Record the outcome now, or hold it if the ledger cannot take it yet. One the
        ledger's database refuses (``LedgerRefused``) is recorded as refused behind it,
        as a storage fault is held: the call's answer is not lost with it. Any other
        error no wait clears (a bug) raises, and is recorded as refused behind it."""
        queue = self.held.get(op_id)
        if queue is not None:  # an earlier outcome of this operation waits: keep the order
            queue.append(update)
            return
        try:
            await self._core.outcomes.resolve(op_id, update)
        except Exception as exc:
            again = retryable(exc)
            if again or refused(exc, 1):  # a refusal too: the drain records it so
                self.held[op_id] = [update]
                self._tries[op_id] = 1
                self._core.spawn(self.drain, op_id)
            if not again and not isinstance(exc, LedgerRefused):
                raise

    async def drain(self, op_id: str) -> None:
        """Write what is held for one operation, in order (the boundary retries a failure
        that may clear; an outcome refused for ever is recorded so, and the rest goes on)."""
        queue = self.held.get(op_id, [])
        while queue:
            try:
                await self._core.outcomes.resolve(op_id, queue[0])
            except Exception as exc:
                tries = self._tries[op_id] = self._tries.get(op_id, 0) + 1
                if not refused(exc, tries):
                    raise
                await self._keep_refused(op_id, queue[0], exc)
                self._core.health.failed("drain", exc, retrying=False)  # reported once
            self._tries.pop(op_id, None)
            queue.pop(0)
        self.held.pop(op_id, None)

    async def _keep_refused(self, op_id: str, update: OutcomeUpdate, exc: Exception) -> None:
        """What a refused outcome proved, kept: a final answer as ``unknown`` (its evidence
        and the refusal; a read-back then decides), an acceptance as evidence; where the
        ledger refuses that too, in the log. Raises only an error that may clear (then
        the boundary retries, and this outcome is refused again first)."""
        refusal = Evidence.local(
            "outcome_refused", f"the ledger refused {update.event.value}: {describe(exc)}"
        )
        evidence = [refusal, *update.evidence]
        try:
            if update.event is OpEvent.ACCEPTED:  # the call goes on: its answer follows
                await self._core.backend.note(
                    op_id,
                    f"evidence_{update.event.value}",  # derived from the OpEvent
                    {"evidence": [e.to_json() for e in evidence]},
                )
            else:  # R3: an answer the ledger does not hold is in doubt, not lost
                cause = update.cause or Cause.LOCAL_ERROR
                lost = OutcomeUpdate(OpEvent.LOST, evidence, cause=cause)
                await self._core.outcomes.resolve(op_id, lost)
        except Exception as again:
            if retryable(again) and not refused(again, UNCLASSIFIED_TRIES):
                raise
            log.error(
                "outcome of %s refused by the ledger and not kept there (%s): %s",
                op_id,
                describe(again),
                [e.to_json() for e in evidence],
            )

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
