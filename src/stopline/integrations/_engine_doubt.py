"""When an engine's retry of a call in doubt can learn its outcome (R13), for both engines.

An engine retries a failed activity or step at once, or after its own short
backoff. The retry reaches the same operation: in doubt, it is read back first
(R5). Two doubts are no outcome nobody can prove, only one no look can decide
*yet*, and the retry waits for the look that can (``until_decidable``):

- **"Not yet"**: a read-back that finds nothing before the call's horizon proves
  nothing: the operation stays ``unknown`` and the retry raises
  ``OperationInDoubt``. Once the horizon has passed, the read-back decides (found:
  its result; not found: sent once) (``decided_at``). Temporal's next attempt is
  scheduled at the horizon (``next_retry_delay``), unless none follows; DBOS's step
  waits in place.
- **In flight** (``requested``, ``accepted``): another attempt's call has not
  answered. It is still at work (DBOS resumed the workflow beside it; Temporal
  retried an attempt whose worker froze), or its worker died and the ledger has not
  seen it yet (recovery takes the call, ``unknown``, within a lease). Sent again it
  would be a second effect; raised, it spent the engine's retries at the engine's
  pace, and the last one failed a workflow whose call may have succeeded (ADRs 0102,
  0105). The retry waits for the call's answer, or for recovery to take it, then
  passes the gate again, as for any other status.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from stopline.domain.vocab import OpStatus
from stopline.errors import OperationInDoubt, RunFenced, UnknownOperation
from stopline.integrations._engines import EngineGate
from stopline.runtime.ledger import Ledger

__all__ = ["LOOK_EVERY", "decided_at", "in_flight", "until_decidable"]

# a retry waiting for its horizon (or a call in flight) looks for a cancel this often
LOOK_EVERY = 1.0


def in_flight(exc: OperationInDoubt) -> bool:
    """Whether the operation in doubt is a call in flight (``requested``, ``accepted``)."""
    return isinstance(exc.status, OpStatus) and exc.status.in_flight


async def decided_at(ledger: Ledger, exc: OperationInDoubt) -> float | None:
    """The moment (epoch seconds) after which a read-back of the operation in doubt
    decides: its horizon, while it is ``unknown`` and the horizon is still ahead and
    the operation can be read back here; ``None`` when a later look would prove no
    more than this one did (no verifier: review; the horizon passed: the read-back
    could not tell)."""
    if exc.status is not OpStatus.UNKNOWN:
        return None
    try:
        op = await ledger.backend.get_operation(exc.op_id)
    except UnknownOperation:
        return None
    settler = ledger.core.settler
    horizon = settler.horizon_of(op)
    if op.status is not OpStatus.UNKNOWN or not op.can_verify or not settler.can_verify_here(op):
        return None
    if horizon is None or horizon <= time.time():
        return None
    return horizon


async def until_decidable(
    gate: EngineGate,
    run_id: str,
    exc: OperationInDoubt,
    at: float | None,
    *,
    until: float | None = None,
    look: Callable[[], Awaitable[None]] | None = None,
) -> bool:
    """Wait in place until the gate can decide the operation in doubt: ``at`` (its
    horizon, ``decided_at``) has passed, or (``at`` is ``None``) its call in flight has
    answered or been taken from a dead worker. True then (pass the gate again); False
    when ``until`` (epoch seconds: the wait's own bound) came first. ``exc`` when no
    look can decide it (neither a horizon ahead nor a call in flight: review).

    A cancel ends the wait: stopline's as its gate would refuse (``RunFenced``), the
    engine's as ``look`` (called after each wait) raises it. An answer recorded in this
    process wakes it at once; another process's is seen at the next look."""
    if at is None and not in_flight(exc):
        raise exc
    while at is None or time.time() < at:
        if at is None:
            op = await gate.ledger.backend.get_operation(exc.op_id)
            if not op.status.in_flight:
                return True  # answered (or taken from a dead worker): the gate decides now
        if await gate.is_fenced(run_id):
            raise RunFenced(run_id, exc.op_id)
        step = LOOK_EVERY if until is None else min(LOOK_EVERY, until - time.time())
        if step <= 0:
            return False
        if at is None:
            await gate.ledger.wait_for_change(run_id, poll=step)
        else:
            await asyncio.sleep(min(at - time.time(), step))
        if look is not None:
            await look()
    return True
