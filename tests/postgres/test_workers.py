"""Many workers in separate processes on one PostgreSQL ledger (R1, R2 across processes).

Three worker processes run keyed workflows; a fourth process cancels; a worker
is killed with SIGKILL mid-call; a worker's LISTEN connection is terminated by
the server. In every case: no ``gate_passed`` after the cancel in ledger order
(R1), and after recovery every operation is resolved or in review (R2).
Barriers are pipe messages and ledger state; nothing sleeps to synchronise.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing.process import BaseProcess
from pathlib import Path

import anyio
import pytest

import stopline
from stopline import Policy
from stopline.ledger.backend import RunSpec
from tests.conftest import FAST_VERIFY
from tests.postgres import workers

pytestmark = pytest.mark.timeout(90)
_RESOLVED_OR_REVIEW = {"committed", "not_committed", "prevented", "compensated", "needs_review"}
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["stopline", "anyio", "psycopg", "tests.postgres.workers"])


class Worker:
    def __init__(self, plan: workers.Plan) -> None:
        self.plan = plan
        self.pipe, child = _CTX.Pipe()
        self.proc: BaseProcess = _CTX.Process(target=workers.worker, args=(plan, child))
        self.proc.start()
        child.close()
        self.seen: list[str] = []

    def until(self, marker: str) -> list[str]:
        """Read markers until ``marker``; fail on silence, an early exit or an error."""
        while marker not in self.seen:
            if not self.pipe.poll(30):
                raise AssertionError(f"worker {self.plan.run_id} went silent after {self.seen}")
            try:
                got = self.pipe.recv_bytes().decode()
            except EOFError:
                self.proc.join(5)
                raise AssertionError(
                    f"worker {self.plan.run_id} exited ({self.proc.exitcode}) after {self.seen}"
                ) from None
            if got.startswith("E:") and marker != got:
                raise AssertionError(f"worker {self.plan.run_id} failed: {got} after {self.seen}")
            self.seen.append(got)
        return self.seen

    def send(self, word: bytes) -> None:
        self.pipe.send_bytes(word)

    def finish(self) -> None:
        self.until("F")
        self.proc.join(30)
        assert self.proc.exitcode == 0, f"worker {self.plan.run_id} exited {self.proc.exitcode}"

    def kill(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(30)


def cancel_from_another_process(url: str, run_ids: list[str]) -> None:
    proc = _CTX.Process(target=workers.canceller, args=(url, run_ids))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0, f"the canceller exited {proc.exitcode}"


def settle_and_check(url: str, provider: str, run_ids: list[str]) -> dict[str, str]:
    """Recover and reconcile as a fresh worker would, then check R1 and R2.

    Returns op id -> status.
    """

    async def main() -> dict[str, str]:
        tool = workers.make_tool(provider)
        async with stopline.open(url, verify=FAST_VERIFY, tools=[tool]) as ledger:
            await ledger.reconcile(budget=FAST_VERIFY)
            statuses: dict[str, str] = {}
            for run_id in run_ids:
                # the run's state may still read "settling": a worker that resolved its last
                # operation can close before advancing the run, and nothing advances it later
                # (reported to the runtime); R1 and R2 are about the operations
                events = await ledger.backend.events(run_id)
                cancels = [e.seq for e in events if e.kind == "cancel"]
                assert cancels, f"run {run_id} was not cancelled"
                passed = [e.seq for e in events if e.kind == "gate_passed"]
                assert all(seq < cancels[0] for seq in passed), f"R1 broken in {run_id}"
                for op in await ledger.backend.operations(run_id):
                    statuses[op.id] = op.status.value
            left = {k: v for k, v in statuses.items() if v not in _RESOLVED_OR_REVIEW}
            assert not left, f"R2: operations neither resolved nor in review: {left}"
            done = workers.effects(provider)
            assert len(done) == len(set(done)), "an effect happened twice"
            assert all(statuses.get(key) == "committed" for key in done)
            return statuses

    return anyio.run(main)


def test_three_workers_cancelled_from_a_fourth_process(pg_url: str, tmp_path: Path) -> None:
    provider = str(tmp_path / "provider.db")
    plans = [
        workers.Plan(pg_url, provider, "run_w0", block_at=3),  # blocked in a call: interrupted
        workers.Plan(pg_url, provider, "run_w1", block_at=3),
        # dispatching as fast as it can: the cancel races its gates (R1 in ledger order)
        workers.Plan(pg_url, provider, "run_w2", policy=Policy.AT_BOUNDARY),
    ]
    pool = [Worker(plan) for plan in plans]
    pool[0].until("b3")
    pool[1].until("b3")
    pool[2].until("c3")
    cancel_from_another_process(pg_url, [p.run_id for p in plans])
    for w in pool:
        w.finish()  # the blocked calls were interrupted by the notification
    statuses = settle_and_check(pg_url, provider, [p.run_id for p in plans])
    for run in ("run_w0", "run_w1"):
        # interrupted locally: unknown, then read back (R3): the effect never happened
        assert statuses[f"{run}/k3"] == "not_committed"


def test_worker_killed_mid_call_is_recovered_by_another(pg_url: str, tmp_path: Path) -> None:
    provider = str(tmp_path / "provider.db")
    plans = [
        workers.Plan(pg_url, provider, "run_k0", block_at=2),  # killed in call 2
        workers.Plan(pg_url, provider, "run_k1", block_at=1),
        workers.Plan(pg_url, provider, "run_k2", block_at=1),
    ]
    pool = [Worker(plan) for plan in plans]
    pool[0].until("b2")
    pool[1].until("b1")
    pool[2].until("b1")
    pool[0].kill()
    cancel_from_another_process(pg_url, [p.run_id for p in plans])
    pool[1].finish()
    pool[2].finish()
    statuses = settle_and_check(pg_url, provider, [p.run_id for p in plans])
    assert statuses["run_k0/k2"] == "not_committed"  # crash -> unknown -> read back
    assert statuses["run_k0/k1"] == "committed"


def test_dropped_notification_connection(pg_url: str, tmp_path: Path) -> None:
    """The listener is terminated by the server; a cancel lands while it is down.

    The fence still refuses the next dispatch of a sibling run (R1 without any
    notification); once the listener is back, the cancel reaches the blocked call.
    """
    import psycopg

    provider = str(tmp_path / "provider.db")

    async def make_root() -> None:
        async with stopline.open(pg_url) as ledger:
            await ledger.backend.create_run(RunSpec("run_root", "root", "user:1", "default"))

    anyio.run(make_root)
    blocked = Worker(
        workers.Plan(
            pg_url, provider, "run_x", block_at=1, hold_listener="go", parent_run="run_root"
        )
    )
    stepping = Worker(
        workers.Plan(
            pg_url,
            provider,
            "run_y",
            wait_each=True,
            hold_listener="forever",
            parent_run="run_root",
        )
    )
    blocked.until("b1")
    stepping.until("S")
    stepping.send(b"next")
    stepping.until("c0")
    pids = [int(m[4:]) for w in (blocked, stepping) for m in w.seen if m.startswith("pid:")]
    with psycopg.connect(pg_url.partition("?")[0], autocommit=True) as conn:
        killed = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'stopline-listen' AND pid = ANY(%s)",
            (pids,),
        ).fetchall()
    assert len(killed) == 2  # both workers' listeners
    blocked.until("L")
    cancel_from_another_process(pg_url, ["run_root"])  # fences run_x and run_y
    stepping.until("L")
    stepping.send(b"next")  # its next dispatch meets the fence, not a notification
    stepping.finish()
    blocked.send(b"go")  # now the listener comes back and catches up
    blocked.finish()
    statuses = settle_and_check(pg_url, provider, ["run_x", "run_y"])
    assert statuses["run_y/k1"] == "prevented"
    assert statuses["run_x/k1"] == "not_committed"
