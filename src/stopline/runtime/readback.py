"""Reading a destination back (R5): how hard to try, which read-back applies, one
bounded look.

A read-back that finds nothing proves "not committed" only once nothing can land
any more (R13). The horizon a tool declares or a call states bounds that (the
settler's ``not_yet``); with none, the effect ends with the local call. Of a call
crash recovery took from a worker whose process it did not see gone (its lease
lapsed: stopped, stalled, partitioned, ``LEASE_LAPSED`` in its evidence), that end
is not known (``sender_may_still_send``): the settler's ``not_yet`` reads "not
found" there as no answer, the call stays ``unknown`` and goes to review when the
budget is spent, and a found effect still proves it happened (ADR 0069). Else a
re-entry sent it again while the first request could still land.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

from stopline.domain.limits import check_backoff
from stopline.domain.vocab import Cause, EvidenceKind
from stopline.errors import InvalidInput
from stopline.runtime.tool import ReadBack, Verdict

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

    from stopline.domain.model import OperationRecord
    from stopline.runtime.context import CallContext
    from stopline.runtime.tool import Tool

Verifier = Callable[["CallContext"], Awaitable[object]]

__all__ = [
    "CRASH",
    "LEASE_LAPSED",
    "READS_AT_ONCE",
    "STILL_SENDING",
    "VerifyBudget",
    "ask",
    "sender_may_still_send",
]

# the evidence crash recovery writes of every call it takes from a worker it took for
# dead, and the item it adds after it where only the worker's lease lapsed (its process
# not seen gone): a request that worker sent may still land
CRASH = "crash"
LEASE_LAPSED = "lease_lapsed"
# what a read-back that found nothing for such a call says beside what it found
STILL_SENDING = "its worker's lease lapsed with it in flight: it may still land"


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyBudget:
    """How hard to try a read-back before handing an operation to review.

    ``attempts`` read-backs, the first ``first_delay`` seconds after the answer was
    lost (a provider that is still finishing gets that long), each next one after a
    delay growing by ``factor`` up to ``max_delay``. An operation whose horizon
    (R13) is still ahead when the budget is spent gets one more read-back once it
    has passed. A read-back that gives no answer within ``read_timeout`` seconds
    is one that found no answer (infinity: no bound).
    """

    attempts: int = 6
    first_delay: float = 0.2
    factor: float = 2.0
    max_delay: float = 10.0
    read_timeout: float = 30.0

    def __post_init__(self) -> None:  # checked when made (InvalidInput), as a Retry is
        waits = ("first_delay", "factor", "max_delay", "read_timeout")
        check_backoff(self.attempts, **{what: getattr(self, what) for what in waits})
        if not self.read_timeout > 0:
            raise InvalidInput("read_timeout", f"{self.read_timeout}: must be more than 0 s")

    def delays(self) -> list[float]:
        """The wait before each read-back, the first included."""
        out, delay = [], self.first_delay
        for _ in range(self.attempts):
            out.append(min(delay, self.max_delay))
            delay *= self.factor
        return out


# read-backs a process has under way at once: a reconcile of thousands, or a cancelled
# tree's wake, asks its providers this many at a time (waits between reads take no slot)
READS_AT_ONCE = 16


def read_back_of(
    tools: Mapping[str, Tool[Any]], op: OperationRecord
) -> tuple[Tool[Any] | None, Verifier | None]:
    """The operation's tool here and its read-back (a correction's own for a correction):
    ``(None, None)`` when its tool is not registered here; with ``op.can_verify`` false,
    no process can read it back (R5: it goes to review)."""
    tool = tools.get(op.tool)
    if tool is None:
        return None, None
    return tool, tool.compensation_verify_fn if op.compensates else tool.verify_fn


def sender_may_still_send(op: OperationRecord) -> bool:
    """Whether crash recovery last took ``op`` from a worker it did not see die (its lease
    lapsed, its process not seen gone): a request that worker sent may still land, and
    nothing says until when but a horizon."""
    if op.cause is not Cause.CRASH:
        return False
    for item in reversed(op.evidence):
        if item.kind is EvidenceKind.LOCAL and item.ref in (LEASE_LAPSED, CRASH):
            return item.ref == LEASE_LAPSED
    return False


def no_read_back(tools: Mapping[str, Tool[Any]], op: OperationRecord) -> bool:
    """Nobody can read the operation back: its tool here has no read-back, or its tool
    is not here and declared none when it passed the gate."""
    tool, verify = read_back_of(tools, op)
    return verify is None and (tool is not None or not op.can_verify)


async def ask(
    verify: Verifier,
    ctx: CallContext,
    limit: float,
    slots: anyio.CapacityLimiter,
) -> ReadBack:
    """One read-back in one of ``slots``, its answer as a ``ReadBack``; one that gives
    none within ``limit`` seconds found no answer (a verifier that hangs holds nothing
    up, and proves nothing). Raises what the verifier raised."""
    async with slots:
        with anyio.move_on_after(limit):
            return ReadBack.of(await verify(ctx))
    return ReadBack(Verdict.UNKNOWN, detail=f"the read-back gave no answer within {limit:g} s")
