"""When an engine's retry of a call in doubt can learn its outcome (R13), for both engines.

An engine retries a failed activity or step at once, or after its own short
backoff. The retry reaches the same operation: in doubt, it is read back first
(R5). A read-back that finds nothing before the call's horizon proves nothing
("not yet"): the operation stays ``unknown`` and the retry raises
``OperationInDoubt``. That is no outcome nobody can prove: once the horizon has
passed, the read-back decides (found: its result; not found: sent once). So the
retry waits for it: Temporal's next attempt is scheduled at the horizon
(``next_retry_delay``), DBOS's step waits in place and looks again.
"""

from __future__ import annotations

import time

from stopline.domain.vocab import OpStatus
from stopline.errors import OperationInDoubt, UnknownOperation
from stopline.runtime.ledger import Ledger

__all__ = ["decided_at"]


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
