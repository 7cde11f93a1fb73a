"""The ledger contract for truth after the fact: leases, orphans, compensation links.

Mixed into each backend's contract class next to ``LedgerContract``.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from stopline.domain.model import Evidence, OperationSpec
from stopline.domain.vocab import Cause, OpEvent, OpStatus, RunEvent
from stopline.errors import IllegalTransition
from stopline.ledger.backend import Backend, GateVerdict, OutcomeUpdate
from tests.ledger.contract import COMMIT, op_spec, run_spec

CRASH = [Evidence.local("crash", "worker died")]


def spec_of(op_id: str, worker: str, run_id: str = "run_a") -> OperationSpec:
    return dataclasses.replace(op_spec(op_id, run_id=run_id), worker=worker)


class TruthContract:
    async def test_heartbeat_registers_and_retires(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.heartbeat("w1", host="h", pid=1, lease_until=time.time() + 30)
        await backend.gate(spec_of("run_a/1", "w1"))
        (lease,) = await backend.in_flight_workers()
        assert (lease.worker, lease.host, lease.pid, lease.in_flight) == ("w1", "h", 1, 1)
        assert lease.lease_until is not None and lease.lease_until > time.time()
        await backend.heartbeat("w1", host="h", pid=1, lease_until=0)  # retired, work in flight
        (lease,) = await backend.in_flight_workers()
        assert lease.lease_until == 0  # kept: the next recovery needs it

    async def test_unregistered_worker_is_listed_without_lease(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(spec_of("run_a/1", "ghost"))
        (lease,) = await backend.in_flight_workers()
        assert lease.worker == "ghost" and lease.lease_until is None and lease.host is None

    async def test_recover_orphans_marks_only_the_dead(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        for n, worker in enumerate(["dead", "dead", "alive"]):
            await backend.gate(spec_of(f"run_a/{n}", worker))
        await backend.record("run_a/1", OutcomeUpdate(OpEvent.ACCEPTED, [Evidence.local("ack")]))
        await backend.gate(spec_of("run_a/done", "dead"))
        await backend.record("run_a/done", COMMIT)
        recovered = await backend.recover_orphans(["dead"], CRASH)
        assert sorted(op.id for op in recovered) == ["run_a/0", "run_a/1"]
        assert {op.status for op in recovered} == {OpStatus.UNKNOWN}
        assert {op.cause for op in recovered} == {Cause.CRASH}
        assert (await backend.get_operation("run_a/2")).status is OpStatus.REQUESTED
        assert (await backend.get_operation("run_a/done")).status is OpStatus.COMMITTED
        assert [lease.worker for lease in await backend.in_flight_workers()] == ["alive"]
        again = await backend.recover_orphans(["dead"], CRASH)
        assert again == []  # idempotent
        kinds = [e.kind for e in await backend.events("run_a") if e.op_id == "run_a/0"]
        assert kinds == ["gate_passed", "lost"]

    async def test_retry_records_its_own_worker(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(spec_of("run_a/1", "first"))
        await backend.record("run_a/1", OutcomeUpdate(OpEvent.REJECTED, []))
        await backend.gate(spec_of("run_a/1", "second"))
        assert (await backend.get_operation("run_a/1")).worker == "second"

    async def test_begin_compensation_links_atomically(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec("run_a/1"))
        await backend.record("run_a/1", COMMIT)
        await backend.run_event("run_a", RunEvent.CANCEL, by="u")  # keeps `compensate`
        comp = dataclasses.replace(op_spec("run_a/1~compensate"), compensates="run_a/1")
        gate = await backend.begin_compensation(comp, [Evidence.local("asked")])
        assert gate.verdict is GateVerdict.PASSED
        assert (await backend.get_operation("run_a/1")).status is OpStatus.COMPENSATING
        linked = await backend.compensations("run_a/1")
        assert [(c.id, c.status, c.compensates) for c in linked] == [
            ("run_a/1~compensate", OpStatus.REQUESTED, "run_a/1")
        ]

    async def test_begin_compensation_of_uncommitted_records_nothing(
        self, backend: Backend
    ) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec("run_a/1"))
        before = await backend.events("run_a")
        comp = dataclasses.replace(op_spec("run_a/1~compensate"), compensates="run_a/1")
        with pytest.raises(IllegalTransition):
            await backend.begin_compensation(comp, [Evidence.local("asked")])
        assert await backend.events("run_a") == before
        assert await backend.compensations("run_a/1") == []

    async def test_review_items_come_from_the_open_index(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec("run_a/1"))
        await backend.record("run_a/1", OutcomeUpdate(OpEvent.LOST, CRASH, cause=Cause.CRASH))
        await backend.record("run_a/1", OutcomeUpdate(OpEvent.ESCALATED, CRASH))
        queue = await backend.unresolved(statuses={OpStatus.NEEDS_REVIEW})
        assert [op.id for op in queue] == ["run_a/1"]
        assert await backend.unresolved() == []  # review items are not in doubt by default
