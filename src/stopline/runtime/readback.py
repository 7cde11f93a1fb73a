"""Reading a destination back (R5): how hard to try, and one bounded look."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

from stopline.domain.limits import check_backoff
from stopline.errors import InvalidInput
from stopline.runtime.tool import ReadBack, Verdict

if TYPE_CHECKING:
    from stopline.runtime.context import CallContext

__all__ = ["READS_AT_ONCE", "VerifyBudget", "ask"]


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


async def ask(
    verify: Callable[[CallContext], Awaitable[object]],
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
