"""The reconciler (R3, R5) and crash recovery (R2) against real SQLite files."""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import time

import anyio
import pytest

import stopline
from stopline import Cause, EvidenceKind, Headline, OpStatus, ReadBack, Verdict, VerifyBudget
from stopline.domain.model import OperationSpec
from stopline.domain.vocab import Cancellable
from stopline.ledger.backend import RunSpec
from stopline.ledger.engine.reads import in_flight_where
from tests.truth.helpers import quiesce

ONE_TRY = VerifyBudget(attempts=1)
THREE_TRIES = VerifyBudget(attempts=3, first_delay=0.001, factor=1.0)


class Pay:
    """A payments tool whose truth the test sets; it counts every write it receives."""

    def __init__(self, *, verifiable: bool = True) -> None:
        self.truth: dict[str, Verdict] = {}
        self.writes: list[str] = []
        self.reads: list[str] = []
        self.tool: stopline.Tool[str] = stopline.Tool(self._pay, name="pay")
        self.tool.wants_context = True
        if verifiable:
            self.tool.verify_fn = self._verify

    async def _pay(self, ctx: stopline.CallContext) -> str:
        self.writes.append(ctx.key)
        return "paid"

    async def _verify(self, ctx: stopline.CallContext) -> ReadBack:
        self.reads.append(ctx.key)
        return ReadBack(self.truth.get(ctx.key, Verdict.UNKNOWN), f"psp:{ctx.key}")


async def left_behind(
    url: str, *, worker: str, n: int = 1, can_verify: bool = True, pid: int | None = None
) -> list[str]:
    """Operations a worker left in flight, written straight to the ledger as it would."""
    ids = [f"run_x/{i}:pay" for i in range(n)]
    async with stopline.open(url) as ledger:
        backend = ledger.backend
        await backend.create_run(RunSpec(id="run_x", name="job", owner="user:1", tenant="t"))
        if pid is not None:
            await backend.heartbeat(worker, host=socket.gethostname(), pid=pid, lease_until=1e12)
        for op_id in ids:
            await backend.gate(
                OperationSpec(
                    id=op_id,
                    run_id="run_x",
                    tool="pay",
                    args_digest="d",
                    description="pay",
                    cancellable=Cancellable.NEVER,
                    can_verify=can_verify,
                    can_compensate=False,
                    worker=worker,
                )
            )
    return ids


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


async def test_recovery_marks_a_dead_workers_operations_unknown(ledger_url: str) -> None:
    ids = await left_behind(ledger_url, worker="w_dead", n=3, pid=dead_pid())
    pay = Pay()
    pay.truth = {ids[0]: Verdict.COMMITTED, ids[1]: Verdict.NOT_COMMITTED}
    async with stopline.open(ledger_url, verify=ONE_TRY, tools=[pay.tool]) as ledger:
        report = await ledger.recover()  # again: idempotent, nothing left to find
        assert report.recovered == ()
        await quiesce(ledger)
        ops = {op.id: op for op in await ledger.backend.operations("run_x")}
        assert [ops[i].status for i in ids] == [
            OpStatus.COMMITTED,
            OpStatus.NOT_COMMITTED,
            OpStatus.NEEDS_REVIEW,  # no answer within the budget
        ]
        assert {ops[i].cause for i in ids} == {Cause.CRASH}
        assert pay.writes == []  # R5: nothing re-sent


async def test_live_worker_is_left_alone(ledger_url: str) -> None:
    await left_behind(ledger_url, worker="w_live", pid=os.getpid())  # this process: alive
    async with stopline.open(ledger_url) as ledger:
        op = await ledger.backend.get_operation("run_x/0:pay")
        assert op.status is OpStatus.REQUESTED


async def test_expired_lease_is_dead_even_if_the_pid_lives(ledger_url: str) -> None:
    await left_behind(ledger_url, worker="w_stale", pid=os.getpid())
    with sqlite3.connect(ledger_url.removeprefix("sqlite:///")) as conn:
        conn.execute("UPDATE workers SET lease_until = 1 WHERE id = 'w_stale'")
    async with stopline.open(ledger_url) as ledger:
        op = await ledger.backend.get_operation("run_x/0:pay")
        assert op.status is OpStatus.UNKNOWN and op.cause is Cause.CRASH


async def test_unregistered_worker_is_dead_once_stale(ledger_url: str) -> None:
    await left_behind(ledger_url, worker="")  # never registered: only staleness tells
    async with stopline.open(ledger_url) as ledger:
        assert (await ledger.backend.get_operation("run_x/0:pay")).status is OpStatus.REQUESTED
    with sqlite3.connect(ledger_url.removeprefix("sqlite:///")) as conn:
        conn.execute("UPDATE operations SET updated_at = ?", (time.time() - 3600,))
    async with stopline.open(ledger_url) as ledger:
        assert (await ledger.backend.get_operation("run_x/0:pay")).status is OpStatus.UNKNOWN


async def test_recover_again_keeps_one_lease_loop(
    ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ledger.recover()`` after the open's own (S17's explicit call) recovers again but
    starts no second loop renewing the lease and sweeping: each call added one."""
    from stopline.runtime.recovery import Workers

    loops: list[Workers] = []
    keep_alive = Workers.keep_alive

    async def counted(self: Workers) -> None:
        loops.append(self)
        await keep_alive(self)

    monkeypatch.setattr(Workers, "keep_alive", counted)
    async with stopline.open(ledger_url) as ledger:
        await ledger.recover()
        await ledger.recover()
        await anyio.wait_all_tasks_blocked()  # every loop spawned has started
        assert len(loops) == 1


async def test_a_lease_set_on_an_open_ledger_is_renewed_under_at_once(ledger_url: str) -> None:
    """``ledger.lease`` set on an open ledger whose loop already waits is the lease the
    next renewal records, within a step of the loop, not after the wait the default
    lease (30 s) set: a short lease taken for quick recovery was recorded only ten
    seconds later."""
    path = ledger_url.removeprefix("sqlite:///")
    async with stopline.open(ledger_url) as ledger:
        await anyio.wait_all_tasks_blocked()  # the lease's loop waits out the open's lease
        ledger.lease = 0.9

        def recorded() -> float:
            with sqlite3.connect(path) as conn:
                row = conn.execute(
                    "SELECT lease_until FROM workers WHERE id = ?", (ledger.worker_id,)
                ).fetchone()
            return float(row[0])

        with anyio.fail_after(6):  # the old loop's first renewal came at 10 s
            while recorded() > time.time() + 5:  # noqa: ASYNC110 (the open's 30 s lease)
                await anyio.sleep(0.05)
        assert recorded() <= time.time() + 0.9


async def test_a_clean_close_retires_the_worker(ledger_url: str) -> None:
    """What a closed runtime left in flight is recovered at once by the next start."""
    async with (
        stopline.open(ledger_url) as first,
        first.run("job", owner="user:1", run_id="run_y") as run,
    ):
        spec = OperationSpec(
            id="run_y/1:pay",
            run_id=run.id,
            tool="pay",
            args_digest="d",
            description="pay",
            cancellable=Cancellable.NEVER,
            can_verify=True,
            can_compensate=False,
            worker=first.worker_id,
        )
        await first.backend.gate(spec)
    pay = Pay()
    pay.truth["run_y/1:pay"] = Verdict.COMMITTED
    async with stopline.open(ledger_url, verify=ONE_TRY, tools=[pay.tool]) as second:
        await quiesce(second)
        op = await second.backend.get_operation("run_y/1:pay")
        assert op.status is OpStatus.COMMITTED
        assert EvidenceKind.READ_BACK in {e.kind for e in op.evidence}


async def test_recovery_reads_only_the_open_index(ledger_url: str) -> None:
    async with stopline.open(ledger_url):
        pass
    with sqlite3.connect(ledger_url.removeprefix("sqlite:///")) as conn:
        plan = conn.execute(
            "EXPLAIN QUERY PLAN SELECT id FROM operations INDEXED BY ops_open"
            f" WHERE {in_flight_where()}"
        ).fetchall()
    assert any("ops_open" in row[-1] for row in plan)
    assert not any(row[-1].startswith("SCAN operations") for row in plan)


async def test_reconcile_one_shot_proves_and_never_resends(ledger_url: str) -> None:
    ids = await left_behind(ledger_url, worker="w_dead", n=4, pid=dead_pid())
    async with stopline.open(ledger_url) as ledger:  # no tools: nothing provable here
        summary = await ledger.reconcile(budget=ONE_TRY)
        assert summary.not_here == tuple(ids)
    pay = Pay()
    pay.truth = {ids[0]: Verdict.COMMITTED, ids[1]: Verdict.NOT_COMMITTED}
    async with stopline.open(ledger_url) as ledger:
        summary = await ledger.reconcile(tools=[pay.tool], budget=THREE_TRIES)
    assert summary.committed == (ids[0],)
    assert summary.not_committed == (ids[1],)
    assert summary.needs_review == (ids[2], ids[3])
    assert summary.checked == 4
    assert pay.writes == []  # R5
    assert pay.reads.count(ids[2]) == 3  # the budget: three read-backs, then review
    assert "1 committed" in str(summary) and summary.to_json()["checked"] == 4


async def test_reconcile_without_verifier_goes_to_review(ledger_url: str) -> None:
    await left_behind(ledger_url, worker="w_dead", can_verify=False, pid=dead_pid())
    async with stopline.open(ledger_url) as ledger:  # the tool is not even registered
        await ledger.reconcile()
        op = await ledger.backend.get_operation("run_x/0:pay")
        assert op.status is OpStatus.NEEDS_REVIEW
        assert op.evidence[-1].ref == "no_verifier"


async def test_reconcile_peeks_at_long_accepted(ledger: stopline.Ledger) -> None:
    pay = Pay()
    accepted = anyio.Event()

    async def slow(ctx: stopline.CallContext) -> str:
        await ctx.accepted(ref="psp")
        accepted.set()
        await anyio.sleep_forever()
        return "never"

    tool: stopline.Tool[str] = stopline.Tool(slow, name="pay")
    tool.verify_fn = pay.tool.verify_fn
    async with anyio.create_task_group() as tg, ledger.run("job", owner="user:1") as run:

        async def call() -> None:
            await run.call(tool, key="p")

        tg.start_soon(call)
        await accepted.wait()
        op_id = f"{run.id}/p"
        summary = await ledger.reconcile(accepted_after=0)
        assert summary.still_accepted == (op_id,)  # no answer: never escalated
        pay.truth[op_id] = Verdict.COMMITTED
        summary = await ledger.reconcile(accepted_after=0)
        assert summary.committed == (op_id,)
        tg.cancel_scope.cancel()


async def test_receipt_says_verifying_while_it_reconciles(ledger_url: str) -> None:
    await left_behind(ledger_url, worker="w_dead", pid=dead_pid())
    reading = anyio.Event()
    answer = anyio.Event()

    async def verify(ctx: stopline.CallContext) -> ReadBack:
        reading.set()
        await answer.wait()
        return ReadBack(Verdict.COMMITTED, "psp:1")

    pay = Pay()
    pay.tool.verify_fn = verify
    async with stopline.open(ledger_url, tools=[pay.tool]) as ledger:
        await reading.wait()
        during = await ledger.receipt("run_x")
        assert during.headline is Headline.VERIFYING
        assert during.message.startswith("The action may already have happened")
        answer.set()
        await quiesce(ledger)
        after = await ledger.receipt("run_x")
        assert after.lines[0].status is OpStatus.COMMITTED


@pytest.mark.parametrize("worker", ["w_dead"])
async def test_cli_style_reconcile_takes_no_arguments(ledger_url: str, worker: str) -> None:
    await left_behind(ledger_url, worker=worker, pid=dead_pid())
    async with stopline.open(ledger_url) as ledger:
        summary = await ledger.reconcile()
    # the open recovered it, and this first pass reports it (ADR 0082)
    assert summary.recovered == ("run_x/0:pay",) and summary.not_here == ("run_x/0:pay",)
