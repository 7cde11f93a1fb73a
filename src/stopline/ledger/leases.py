"""Workers and their leases, as the ledger keeps them for crash recovery (R2)."""

from __future__ import annotations

import dataclasses

__all__ = ["WorkerLease"]


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerLease:
    """A worker that holds operations in flight (requested or accepted).

    ``host``, ``pid`` and ``lease_until`` are ``None`` for a worker that never
    registered (a ledger written before leases, or a backend used directly);
    ``last_activity`` is the newest update among its in-flight operations.
    """

    worker: str
    host: str | None
    pid: int | None
    lease_until: float | None
    last_activity: float
    in_flight: int
