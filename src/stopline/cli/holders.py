"""Who holds a run that has not ended, as far as the ledger shows it.

A run's row names no process. What the ledger does record: the worker (process) that
passed the gate for each call, with its host, pid and lease (R2); and, for a shared
run whose block another run's cancel cut, the owners it was left to (R6, its
``left_to_owners`` event). From these, ``stopline runs``, ``show`` and the console
tell apart a run whose call a live worker holds, one whose worker is gone (its calls
are left for recovery: the next read-write open of the ledger takes them, reads them
back or sends them to review), one left to its owners, and one with no call in flight
(between calls, nothing in the ledger says whether a process holds it). The rule for
a gone worker is recovery's own (``recovery.is_dead``), read here without acting.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Sequence
from typing import Any

from stopline.domain.model import RunRecord
from stopline.domain.vocab import LogKind, OpStatus
from stopline.ledger.backend import Backend
from stopline.ledger.leases import WorkerLease
from stopline.runtime.recovery import DEFAULT_LEASE, is_dead, process_gone

__all__ = ["HeldCall", "Holding", "holdings"]

NO_CALL = "no call in flight"
IN_FLIGHT = frozenset(status for status in OpStatus if status.in_flight)


@dataclasses.dataclass(frozen=True, slots=True)
class HeldCall:
    """A worker holding calls of the run in flight, and what recovery would make of it."""

    lease: WorkerLease
    calls: int  # of this run
    seen: str  # live, gone (process gone), lapsed (lease lapsed), closed, unregistered
    for_recovery: bool  # recovery takes the worker for dead: the next open takes its calls

    def words(self) -> str:
        where = (
            f"pid {self.lease.pid}@{self.lease.host}"
            if self.lease.pid is not None
            else self.lease.worker
        )
        return (
            f"{where}, {self.seen}: left for recovery"
            if self.for_recovery
            else f"{where}, {self.seen}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "worker": self.lease.worker,
            "host": self.lease.host,
            "pid": self.lease.pid,
            "lease_until": self.lease.lease_until,
            "calls_in_flight": self.calls,
            "seen": self.seen,
            "left_for_recovery": self.for_recovery,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Holding:
    """What holds one run that has not ended: workers with its calls in flight, and the
    owners a cancel left it to (each with its state now)."""

    workers: tuple[HeldCall, ...] = ()
    left_to: tuple[tuple[str, str], ...] = ()  # (owner run, its state now)
    cut_by: str | None = None  # the run whose cancel cut its block

    def words(self) -> str:
        parts = [held.words() for held in self.workers]
        if self.left_to:
            owners = ", ".join(
                owner if state in ("running", "pausing", "paused") else f"{owner} ({state})"
                for owner, state in self.left_to
            )
            parts.append(f"left to owners {owners}")
        return "; ".join(parts) or NO_CALL

    def to_json(self) -> dict[str, Any]:
        return {
            "workers": [held.to_json() for held in self.workers],
            "left_to_owners": [{"run": owner, "state": state} for owner, state in self.left_to],
            "cut_by": self.cut_by,
        }


def _held(lease: WorkerLease, calls: int, now: float, host: str) -> HeldCall:
    """What recovery's rule makes of the worker now (``is_dead``), and why: a worker that
    never registered is not called live (nothing says it is), only not taken yet."""
    dead = is_dead(lease, now=now, host=host, me="", lease_seconds=DEFAULT_LEASE)
    if lease.lease_until is None:
        seen = "unregistered"
    elif not dead:
        seen = "live"
    elif process_gone(lease, host):
        seen = "gone"
    else:
        seen = "closed" if lease.lease_until <= 0 else "lapsed"
    return HeldCall(lease, calls, seen, dead)


async def holdings(backend: Backend, runs: Sequence[RunRecord]) -> dict[str, Holding]:
    """The ``Holding`` of each run of ``runs`` that has not ended (others are left out),
    read now: a few reads for the whole list, the log only of runs with owners by a share."""
    open_ids = [run.id for run in runs if not run.state.ended]
    if not open_ids:
        return {}
    now, host = time.time(), socket.gethostname()
    leases = {lease.worker: lease for lease in await backend.in_flight_workers()}
    calls: dict[str, dict[str, int]] = {}
    if leases:  # the calls in flight, through the open-operations index: no run's history
        listed = set(open_ids)
        in_flight = sum(lease.in_flight for lease in leases.values())
        for op in await backend.unresolved(in_flight, statuses=IN_FLIGHT):
            if op.run_id in listed and op.worker in leases:
                held = calls.setdefault(op.run_id, {})
                held[op.worker] = held.get(op.worker, 0) + 1
    left: dict[str, tuple[list[str], str | None]] = {}
    for run_id, links in (await backend.owners_of(open_ids)).items():
        if any(not exclusive for exclusive in links.values()):  # held by a share
            events = await backend.events(run_id)
            said = [e for e in events if e.kind == LogKind.LEFT_TO_OWNERS]
            if said:
                owners = said[-1].data.get("owners")
                cut_by = said[-1].data.get("cut_by")
                named = [str(o) for o in owners] if isinstance(owners, list) else []
                left[run_id] = (named, None if cut_by is None else str(cut_by))
    every = sorted({owner for owners, _ in left.values() for owner in owners})
    owner_runs = await backend.get_runs(every) if every else {}
    result = {}
    for run_id in open_ids:
        workers = tuple(
            _held(leases[worker], count, now, host)
            for worker, count in sorted(calls.get(run_id, {}).items())
        )
        owners, cut_by = left.get(run_id, ([], None))
        states = tuple(
            (o, owner_runs[o].state.value if o in owner_runs else "not in the ledger")
            for o in owners
        )
        result[run_id] = Holding(workers, states, cut_by)
    return result
