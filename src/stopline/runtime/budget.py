"""How hard verification tries before an operation goes to review."""

from __future__ import annotations

import dataclasses

__all__ = ["VerifyBudget"]


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyBudget:
    """How hard to try a read-back before handing an operation to review."""

    attempts: int = 6
    first_delay: float = 0.2
    factor: float = 2.0
    max_delay: float = 10.0

    def delays(self) -> list[float]:
        out, delay = [], self.first_delay
        for _ in range(self.attempts - 1):
            out.append(min(delay, self.max_delay))
            delay *= self.factor
        return out
