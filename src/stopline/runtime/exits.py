"""What a tool's exception proves about its call, recorded (R2, R3).

A provider's refusal is ``not_committed``; any other way out of a tool (its own
error, a timeout, a lost connection, a cancel, a ``BaseException``) leaves the call
``unknown`` with its cause, never "not sent" (R3), to be read back. A call its
cancel recorded already, in bulk with its tree, only unwinds.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Generator
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel

from stopline.domain.model import Evidence
from stopline.domain.vocab import Cause, EvidenceKind, OpEvent
from stopline.errors import describe
from stopline.ledger.backend import OutcomeUpdate
from stopline.runtime.outcomes import INTERRUPTED
from stopline.runtime.tool import NoAnswer, Rejected

if TYPE_CHECKING:
    from stopline.runtime.context import CallContext
    from stopline.runtime.core import Core

__all__ = ["record_exit"]


@types.coroutine
def _next_turn(cancel: BaseException) -> Generator[None]:
    """asyncio: one turn of the loop for a task unwinding with ``cancel`` (a bare yield:
    the task is scheduled again, what ``asyncio.sleep(0)`` does without its own
    coroutine). anyio's cancellation is level-triggered: its next pass throws the same
    cancel in again at this yield, and that one is the cancel already going up, taken
    here. Any other (another scope's, a native ``Task.cancel``) goes on up."""
    try:
        yield
    except asyncio.CancelledError as again:
        if again.args != cancel.args:
            raise


async def record_exit(
    core: Core, ctx: CallContext, exc: BaseException, timeout: float | None, *, cancelled: bool
) -> None:
    """What a tool's exception proves, recorded (shielded: the caller may be cancelled)."""
    cancel_class = anyio.get_cancelled_exc_class()
    if ctx.lost_recorded and isinstance(exc, cancel_class):
        # Recorded already, by the cancel, in bulk with its tree: unwind on the next turn
        # of the loop, so that every other call the same cancel interrupted sees its
        # cancel first (a tree's last call is interrupted right after the delivery, not
        # after the unwinding of all the others). One cancel: anyio's next pass of it
        # throws nothing more out of this turn. The frames it came through inside the
        # tool go first: kept through that turn, a tree's thousands of them were half
        # the collector's work in its cancel's window. The cancel goes on up with the
        # frames from here up (the workflow's own). Checked first, and the turn taken
        # with as few objects as it can: each of a tree's interrupted calls holds them
        # until it unwinds, and the collector scans them again and again in the
        # cancel's window. On asyncio a bare yield that takes the cancel's next pass
        # itself: a shield scope (made, entered, and walked by that pass) cost a
        # 10,000-call tree a quarter of its window after the fence. trio keeps anyio's
        # shielded checkpoint.
        exc.__traceback__ = None
        if cancel_class is asyncio.CancelledError:
            await _next_turn(exc)
        else:
            with anyio.CancelScope(shield=True):
                await anyio.lowlevel.checkpoint()
        return
    with anyio.CancelScope(shield=True):
        if isinstance(exc, Rejected):
            evidence = [Evidence(EvidenceKind.PROVIDER_RECEIPT, exc.ref or "rejected", exc.reason)]
            update = OutcomeUpdate(
                OpEvent.REJECTED, evidence, cause=Cause.SERVER_ERROR, error=exc.reason
            )
            await core.outbox.record(ctx.op_id, update)
        elif isinstance(exc, cancel_class):
            cause = Cause.USER_CANCEL if cancelled else Cause.LOCAL_ERROR
            await core.outcomes.lost(ctx, cause, INTERRUPTED)
        elif isinstance(exc, NoAnswer):
            await core.outcomes.lost(ctx, exc.cause, exc.detail)
        elif isinstance(exc, TimeoutError):
            await core.outcomes.lost(ctx, Cause.TIMEOUT, f"no answer within {timeout}s")
        elif isinstance(exc, ConnectionError | OSError):
            await core.outcomes.lost(ctx, Cause.TRANSPORT, describe(exc))
        else:  # any other exception, or a BaseException (KeyboardInterrupt, SystemExit, ...)
            await core.outcomes.lost(ctx, Cause.LOCAL_ERROR, describe(exc))
