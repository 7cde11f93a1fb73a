"""A standalone activity's run ends once, with its execution (ADRs 0103, 0105).

A client's activity (``start_activity``, no workflow) is a run of its own, and no
workflow's code ends it: the worker running the execution's last attempt does
(``close``), as the attempt ends:

- **Its end never costs the activity its answer.** The end is waited for a beat at
  most: a ledger slow to write it (a lock another connection holds, a server that
  does not answer) held the answer back past the heartbeat timeout, and Temporal
  timed the attempt out. Past that beat it goes on in the background, and the
  ledger's trouble with it is never raised into the activity. A fault that may
  clear is retried by the ledger's error boundary (backoff to 5 s while the ledger
  is open, seen in ``ledger.health``); a write the ledger refuses is not retried
  (ADR 0079), and a look ends the run once the refusal is lifted. The ledger's move
  is guarded by the run's state: a second end of an ended run writes nothing, so
  the run ends exactly once.
- **An execution nothing ended is closed as Temporal says it ended** (``look``).
  The worker of its last attempt died (a crash, a SIGKILL, a lost host), or its end
  was refused, or its ledger closed before the retry landed. Every worker with the
  plugin looks at the running standalone activities' runs of its owner and tenant
  (one read of the ledger's running runs) as it starts, then at each of its
  ledger's sweeps for dead workers (a third of its lease). A run whose call is in
  flight under a live worker's lease, or whose attempt runs in this process, is
  left to that attempt; of each other, Temporal is asked what became of the
  execution (one ``describe``). Still running (an attempt runs, or comes): nothing.
  Completed: the run completed. Failed: failed with Temporal's record of the last
  failure. Timed out, terminated or cancelled: fenced with that reason, as a live
  attempt's worker fences it (``closed_under``, ``client_cancel``); it settles as
  any cancelled run does, its call in doubt read back. A run whose activity id is
  derived (``standalone_of`` cannot read it back), or whose execution Temporal no
  longer knows (past its retention), is left as it is.
- **So is a workflow's run nothing ended** (ADR 0119, ``_temporal_closed``): the
  same look asks Temporal of each running workflow's run of its owner and tenant
  that no live worker's call holds; one whose workflow Temporal recorded completed
  or failed (its end refused by the ledger as the workflow ended) is ended so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Iterator
from datetime import timedelta
from typing import Any

import temporalio.client
from temporalio.client import ActivityExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from stopline.domain.lifecycle import tenant_of
from stopline.domain.model import RunRecord
from stopline.domain.vocab import RunState
from stopline.errors import LedgerError, StoplineError, describe
from stopline.integrations._engines import EngineGate, find_run, resumed_after_cancel
from stopline.integrations._temporal_closed import workflow_end, workflow_of
from stopline.integrations._temporal_horizon import ACTIVITY_CLOSED
from stopline.integrations._temporal_runs import standalone_of

__all__ = ["ActivityRuns"]

log = logging.getLogger("stopline.integrations.temporal")

# the running runs a look reads (newest first): the standalone activities' among them
_LOOK = 10_000
_ASK = timedelta(seconds=5)
# a workflow's run Temporal says is running is asked of again after twice the wait each
# time (from a sweep's), up to this: a workflow that waits days for a signal is not one
# ``describe`` per worker at every sweep (ADR 0119)
_ASK_AGAIN_MOST = 600.0


class ActivityRuns:
    """The standalone activities' runs of one plugin: their ends, and the look for
    those nothing ended."""

    def __init__(self, gate: EngineGate) -> None:
        self.gate = gate
        self.client: temporalio.client.Client | None = None
        # the standalone activity (id, execution) of each run of one this worker ran whose
        # id its run does not hold as it is (derived: ``standalone_of`` cannot read it)
        self.derived: dict[str, tuple[str, str]] = {}
        self.here: dict[str, int] = {}  # runs an attempt of which runs in this process
        self._kept: set[asyncio.Task[None]] = set()  # ends gone on in the background
        # each workflow's run found running: when to ask of it again, and the wait
        self._again: dict[str, tuple[float, float]] = {}

    @contextlib.contextmanager
    def running_here(self, run_id: str) -> Iterator[None]:
        """An attempt of the run runs in this process meanwhile: it ends the run itself."""
        self.here[run_id] = self.here.get(run_id, 0) + 1
        try:
            yield
        finally:
            if self.here[run_id] > 1:
                self.here[run_id] -= 1
            else:
                del self.here[run_id]

    def activity_of(self, run_id: str) -> tuple[str, str] | None:
        """The standalone activity (its id, its execution) whose run ``run_id`` is."""
        return self.derived.get(run_id) or standalone_of(run_id)

    # -- the end ------------------------------------------------------------------------
    async def within(self, ending: Coroutine[Any, Any, None], seconds: float) -> None:
        """``ending`` (an attempt's ``close``) waited for ``seconds`` at most; past them
        it goes on in the background, held here until it ends."""
        task = asyncio.create_task(ending)
        try:
            await asyncio.wait({task}, timeout=seconds)
        finally:
            if not task.done():
                self._kept.add(task)
                task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._kept.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a run's end failed: %s", describe(exc), exc_info=exc)

    async def close(self, run_id: str, error: BaseException | None, cancel: str = "") -> None:
        """End the run (``failed`` with ``error``), or fence it with ``cancel``, its reason
        (``end_activity_run``), never raising: the activity's answer goes to Temporal
        whatever the ledger says. A fault that may clear is retried in the background by
        the ledger's error boundary; a refusal is logged there, and left to a look."""
        try:
            await self.end_activity_run(run_id, error, cancel)
        except LedgerError as exc:
            log.warning("run %r's end is retried in the background: %s", run_id, describe(exc))
            try:
                self.gate.ledger.spawn(self.end_activity_run, run_id, error, cancel)
            except StoplineError as closed:  # the ledger closed: a look ends it
                log.warning("run %r is not ended: %s", run_id, describe(closed))
        except StoplineError as exc:  # never the activity's answer in its place
            log.error("run %r is not ended: %s", run_id, describe(exc))

    async def end_activity_run(
        self, run_id: str, error: BaseException | None, cancel: str = ""
    ) -> None:
        """One try at ``close``. Not a run this plugin does not hold: none (the activity
        was cut before its first gated call made it), or another's (refused at the gate).
        A fence is made only while the run is not cancelled (a stopline cancel's own
        request to Temporal comes back as the client's cancel)."""
        gate = self.gate
        run = await find_run(gate.ledger, run_id)
        if run is None or not gate.owns(run) or tenant_of(run) != gate.tenant:
            return
        if cancel:
            if run.cancelled_at is None or resumed_after_cancel(run):
                await gate.fence(run_id, cancel)
        else:
            await gate.end_run(run_id, error)
        self.derived.pop(run_id, None)

    # -- the look for runs nothing ended -------------------------------------------------
    async def look(self) -> None:
        """Look as the worker starts, then at every sweep of the ledger for dead workers:
        a run whose execution Temporal closed is closed as it says. A look the ledger or
        Temporal does not answer is made again at the next sweep; it never stops the
        worker. Runs until cancelled (the worker's end)."""
        while True:
            try:
                await self._look_once()
            except (StoplineError, RPCError) as exc:
                log.warning(
                    "the look for standalone activities' and workflows' runs nothing ended"
                    " failed (made again at the next sweep): %s",
                    describe(exc),
                )
            await asyncio.sleep(self.gate.ledger.lease / 3)

    async def _look_once(self) -> None:
        """The running standalone activities' and workflows' runs of the plugin's owner
        and tenant (one read of the ledger's running runs) whose call is not in flight
        under a live worker's lease, nor their attempt running here: each asked of
        Temporal."""
        backend, gate = self.gate.ledger.backend, self.gate
        running = await backend.list_runs(state=RunState.RUNNING, owner=gate.owner, limit=_LOOK)
        runs = [
            run
            for run in running
            if (standalone_of(run.id) or workflow_of(run.id)) is not None
            and self._ours(run)
            and run.id not in self.here
        ]
        self._again = {r.id: self._again[r.id] for r in runs if r.id in self._again}
        if not runs:
            return
        now = time.time()
        live = {
            lease.worker
            for lease in await backend.in_flight_workers()
            if lease.lease_until is not None and lease.lease_until > now
        }
        held = {
            op.run_id
            for op in await backend.unresolved()
            if op.status.in_flight and op.worker in live
        }
        for run in runs:
            if run.id in held:
                continue
            if standalone_of(run.id) is not None:
                await self._closed_in_temporal(run)
                continue
            at, wait = self._again.get(run.id, (0.0, 0.0))
            if time.monotonic() >= at and not await self._workflow_closed(run):
                wait = min(max(2 * wait, gate.ledger.lease / 3), _ASK_AGAIN_MOST)
                self._again[run.id] = (time.monotonic() + wait, wait)

    def _ours(self, run: RunRecord) -> bool:
        return self.gate.owns(run) and tenant_of(run) == self.gate.tenant

    async def _workflow_closed(self, run: RunRecord) -> bool:
        """A workflow's run closed as Temporal recorded its workflow's end (completed, or
        failed), which its workflow's side could not write (ADR 0119); nothing while the
        workflow runs, or when it ended otherwise, or Temporal no longer knows it.
        Whether it was closed."""
        workflow = workflow_of(run.id)
        if workflow is None or self.client is None:
            return False
        ended = await workflow_end(self.client, *workflow)
        if ended is None:
            return False
        await self.close(run.id, RuntimeError(ended) if ended else None)
        return True

    async def _closed_in_temporal(self, run: RunRecord) -> None:
        """The run closed as Temporal says its execution closed; nothing while it runs,
        or when Temporal no longer knows it (past its retention)."""
        target = standalone_of(run.id)
        if target is None or self.client is None:
            return
        handle = self.client.get_activity_handle(target[0], run_id=target[1] or None)
        try:
            described = await handle.describe(include_last_failure=True, rpc_timeout=_ASK)
        except RPCError as exc:
            if exc.status is RPCStatusCode.NOT_FOUND:
                return  # past its retention: Temporal cannot say
            raise
        status = described.status
        if status is ActivityExecutionStatus.COMPLETED:
            await self.close(run.id, None)
        elif status is ActivityExecutionStatus.FAILED:
            failure = described.raw_info.last_failure
            kind = failure.application_failure_info.type or "ActivityFailure"
            await self.close(run.id, ApplicationError(failure.message, type=kind))
        elif status is ActivityExecutionStatus.CANCELED:
            said = described.canceled_reason or "client cancel"
            await self.close(run.id, None, f"temporal activity cancel: {said}")
        elif status in ACTIVITY_CLOSED:
            await self.close(run.id, None, ACTIVITY_CLOSED[status])
