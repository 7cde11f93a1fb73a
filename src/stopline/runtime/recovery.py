"""Crash recovery: workers, leases, and what a dead worker left in flight (R2, S17).

Every runtime registers itself as a worker (host, pid, a lease it renews in
the background) before it dispatches anything; every operation records the
worker that passed the gate. On start, and at every renewal, a runtime looks
at the workers holding operations ``requested`` or ``accepted`` (through the
open-operations index, never resolved history) and declares one dead when:

- its lease expired (it stopped renewing, or closed: closing retires it), or
- it runs on this host and its process no longer exists (a SIGKILL is seen
  at once, without waiting for the lease; a process that took its pid since
  is not the worker's), or
- it never registered and its operations have not moved for a lease period.

The dead worker's in-flight operations become ``unknown`` (cause ``crash``)
and are queued for verification. Nothing is re-sent: a write is retried only
by a workflow that still holds ``initiate``, with the same id, after a
read-back proved it did not happen (R5).

Their evidence says what recovery saw, no more (R8, ADR 0069): only a process
gone from this host is a proven death. A lapsed lease proves that the worker
stopped renewing it: its process may still exist here (stopped, stalled) or
elsewhere (a partition), with a request in flight that may still land.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio

from stopline.domain.model import Evidence, OperationRecord
from stopline.domain.vocab import OpStatus
from stopline.errors import StoplineError
from stopline.ledger.leases import WorkerLease
from stopline.runtime.readback import CRASH, LEASE_LAPSED, no_read_back

if TYPE_CHECKING:
    from stopline.runtime.core import Core

__all__ = ["RecoveryReport", "Workers", "death_of", "is_dead", "pid_alive", "process_gone"]

DEFAULT_LEASE = 30.0
_LOOK_EVERY = 1.0  # seconds: how soon a lease set on an open ledger is taken up
# a process that started this long after a worker's calls last moved is not the worker's
_REUSE_MARGIN = 5.0


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists and belongs to someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: kill(0) said it exists
    return state not in (b"Z", b"X")


def _started_at(pid: int) -> float | None:
    """When the process ``pid`` started (epoch seconds, to about a second), if told."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            ticks = int(stat.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as system:
            boot = next(int(line.split()[1]) for line in system if line.startswith(b"btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def process_gone(lease: WorkerLease, host: str) -> bool | None:
    """Whether the worker's process is gone from this host: no process by its pid, a
    zombie, or a process that started after the worker's last move (its pid reused).
    None: it cannot be told from here (another host, no pid recorded)."""
    if lease.host != host or lease.pid is None:
        return None
    if not pid_alive(lease.pid):
        return True
    started = _started_at(lease.pid)
    # the margin: btime counts whole seconds, and hosts' clocks differ a little
    return started is not None and started > lease.last_activity + _REUSE_MARGIN


def is_dead(lease: WorkerLease, *, now: float, host: str, me: str, lease_seconds: float) -> bool:
    """The rule above, for one worker holding operations in flight."""
    if lease.worker == me:
        return False
    if lease.lease_until is None:  # never registered
        return lease.last_activity < now - lease_seconds
    if lease.lease_until < now:
        return True
    return process_gone(lease, host) is True


def death_of(lease: WorkerLease, host: str) -> list[Evidence]:
    """What recovery saw of a worker it takes for dead, as evidence: a death only where
    this host shows its process gone (or it closed); a lapsed lease, or a worker never
    registered, with ``LEASE_LAPSED`` saying where its process may be (R8, R13)."""
    who = f"worker {lease.worker} left this call in flight"
    if lease.lease_until is None:
        saw, where = "it never registered", "its process was never recorded"
    elif process_gone(lease, host):
        return [Evidence.local(CRASH, f"{who}: its process (pid {lease.pid}) died")]
    elif lease.lease_until <= 0:
        return [Evidence.local(CRASH, f"{who}: it closed before recording its outcome")]
    elif lease.host == host:
        saw = "its lease lapsed"
        where = f"its process (pid {lease.pid}) still exists on this host, stopped or stalled"
    else:
        saw = "its lease lapsed"
        where = f"its process on host {lease.host or '(unrecorded)'} cannot be seen from here"
    return [
        Evidence.local(CRASH, f"{who}: {saw}"),
        Evidence.local(LEASE_LAPSED, f"{where}: a request it sent may still land"),
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What one recovery pass found."""

    worker: str
    dead_workers: tuple[str, ...]
    recovered: tuple[str, ...]  # operations marked unknown (cause crash)
    queued: int  # operations queued for verification in this process

    def to_json(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "dead_workers": list(self.dead_workers),
            "recovered": list(self.recovered),
            "queued": self.queued,
        }


class Workers:
    """This runtime's worker record, its lease, and the sweep for dead ones."""

    def __init__(self, core: Core, *, lease: float = DEFAULT_LEASE) -> None:
        self._core = core
        self.lease = lease
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.registered = False
        self._renewed_at = 0.0  # monotonic time of the last lease renewal that committed
        # what the open's recovery took, until a reconcile reports it (ADR 0082)
        self._unreported: list[OperationRecord] = []

    async def register(self) -> None:
        await self._core.backend.heartbeat(
            self._core.worker_id,
            host=self.host,
            pid=self.pid,
            lease_until=time.time() + self.lease,
        )
        self.registered = True
        self._renewed_at = time.monotonic()

    async def retire(self) -> None:
        """On a clean close: what this worker left in flight is recovered by the next start."""
        if not self.registered:
            return
        self.registered = False
        with contextlib.suppress(StoplineError):  # the ledger is gone: the lease expires
            await self._core.backend.heartbeat(
                self._core.worker_id, host=self.host, pid=self.pid, lease_until=0.0
            )

    async def sweep(self) -> tuple[list[str], list[OperationRecord]]:
        """Find dead workers holding in-flight operations; mark those unknown."""
        backend = self._core.backend
        now = time.time()
        seen: list[tuple[WorkerLease, list[Evidence]]] = []
        for lease in await backend.in_flight_workers():
            me = self._core.worker_id
            if is_dead(lease, now=now, host=self.host, me=me, lease_seconds=self.lease):
                seen.append((lease, death_of(lease, self.host)))
        recovered: list[OperationRecord] = []
        for lease, evidence in seen:  # each with what was seen of its own worker
            recovered += await backend.recover_orphans([lease.worker], evidence)
        return [lease.worker for lease, _ in seen], recovered

    async def recover(self) -> RecoveryReport:
        """Register, sweep, and queue every unknown operation for verification."""
        core = self._core
        await self.register()
        dead, recovered = await self.sweep()
        unknown = await core.backend.unresolved(statuses={OpStatus.UNKNOWN})
        queued = await self.settle_unknown(unknown, recovered)
        self._unreported += recovered
        for op in recovered:
            core.changed(op.run_id)
        if recovered:  # their runs together, in one step
            core.spawn(core.settler.advance_many, sorted({op.run_id for op in recovered}))
        return RecoveryReport(core.worker_id, tuple(dead), tuple(op.id for op in recovered), queued)

    def take_unreported(self) -> list[OperationRecord]:
        """The operations ``recover`` took that no reconcile has reported yet, once: the
        open's recovery runs before any pass, and may send them to review (ADR 0082)."""
        taken, self._unreported = self._unreported, []
        return taken

    async def settle_unknown(
        self, ops: Sequence[OperationRecord], recovered: Sequence[OperationRecord]
    ) -> int:
        """Of the calls this sweep ``recovered``, those nobody can read back go to review
        now, before this returns (R5): left to a verification in the background, a
        short-lived process (the CLI) closed first, and its run said "verifying" with
        nobody verifying. The rest of ``ops`` is queued for verification (an ``unknown``
        left otherwise is for ``reconcile`` to report); how many were."""
        core = self._core
        swept = {op.id for op in recovered}
        lone = {op.id for op in ops if op.id in swept and no_read_back(core.tools, op)}
        failed: list[OperationRecord] = []

        async def escalate(op: OperationRecord) -> None:
            try:
                await core.settler.read_back(op)
            except StoplineError:
                failed.append(op)  # a verification takes it, retried behind the boundary

        if lone:
            async with anyio.create_task_group() as tg:  # their verdicts, written together
                for op in ops:
                    if op.id in lone:
                        tg.start_soon(escalate, op)
        return self.queue([op for op in ops if op.id not in lone] + failed)

    def queue(self, ops: Sequence[OperationRecord]) -> int:
        settler = self._core.settler
        queued = 0
        for op in ops:
            if op.status is OpStatus.UNKNOWN and settler.can_verify_here(op):
                settler.verify_soon(op)
                queued += 1
        return queued

    async def keep_alive(self) -> None:
        """Renew the lease at a third of its length; sweep for workers that died meanwhile.

        A renewal that fails is retried by the error boundary, at once: the wait is
        measured from the last renewal that committed. The wait is taken in steps of
        at most ``_LOOK_EVERY``, each measured against the lease as it is then: a lease
        set on an open ledger (``ledger.lease``, from any thread) takes effect within
        one step, not after a wait the old lease set."""
        while True:
            due = self._renewed_at + self.lease / 3 - time.monotonic()
            if due > 0:
                await anyio.sleep(min(due, _LOOK_EVERY))
                continue
            await self.register()
            _, recovered = await self.sweep()
            # unknown operations whose tool was registered since, and the newly orphaned
            unknown = await self._core.backend.unresolved(statuses={OpStatus.UNKNOWN})
            await self.settle_unknown(unknown, recovered)
            if recovered:
                self._core.spawn(
                    self._core.settler.advance_many, sorted({op.run_id for op in recovered})
                )
