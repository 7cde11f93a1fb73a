"""Core figures: the gate's cost on SQLite, its throughput, and in-process cancel latency.

Baselines are measured in the same run on the same file, through the same
writer thread, so each ratio is what stopline adds on top of the floor an
async program pays for one durable SQLite transaction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import anyio

import stopline
from stopline.bench.figures import P99_MIN_SAMPLES, Figure, median, percentile, quiet_heap
from stopline.bench.wal import last_commits
from stopline.ledger.sqlite import SQLiteBackend

__all__ = [
    "bare_txn",
    "bare_txn_samples",
    "gate_samples",
    "measure",
    "one_call_run_figure",
    "one_call_runs",
]


@stopline.tool
async def _noop(ctx: stopline.CallContext, n: int) -> int:
    return n


@contextlib.asynccontextmanager
async def bare_txn(path: Path) -> AsyncIterator[Callable[[], Awaitable[float]]]:
    """One bare fence check + insert per call of what it yields (its seconds), each one
    transaction through a writer thread like the ledger's: the floor any durable gate
    pays, to measure interleaved with what it is the baseline of."""
    backend = await SQLiteBackend.open(path)
    try:

        def setup(conn: sqlite3.Connection) -> None:
            conn.execute("CREATE TABLE IF NOT EXISTS bare_fence (id TEXT PRIMARY KEY, fence INT)")
            conn.execute("CREATE TABLE IF NOT EXISTS bare_ops (id TEXT PRIMARY KEY, run TEXT)")
            conn.execute("INSERT OR IGNORE INTO bare_fence VALUES ('r', 0)")

        await backend.transact(setup)  # the same writer thread

        async def once() -> float:
            op_id = uuid.uuid4().hex

            def txn(conn: sqlite3.Connection) -> None:
                row = conn.execute("SELECT fence FROM bare_fence WHERE id = 'r'").fetchone()
                if row[0] == 0:
                    conn.execute("INSERT INTO bare_ops VALUES (?, 'r')", (op_id,))

            start = time.perf_counter()
            await backend.transact(txn)
            return time.perf_counter() - start

        yield once
    finally:
        await backend.close()


async def bare_txn_samples(path: Path, n: int) -> list[float]:
    """``n`` bare fence check + insert transactions in a row (``bare_txn``)."""
    async with bare_txn(path) as once:
        return [await once() for _ in range(n)]


async def gate_samples(
    url: str, n: int, *, durable_outcomes: bool = False
) -> tuple[list[float], list[float]]:
    """Whole gated calls (intent + outcome), and the part before the provider is invoked."""
    whole, before_dispatch = [], []
    dispatched: list[float] = []

    @stopline.tool
    async def mark(ctx: stopline.CallContext, n: int) -> int:
        dispatched.append(time.perf_counter())
        return n

    async with (
        stopline.open(url, durable_outcomes=durable_outcomes) as ledger,
        ledger.run("bench", owner="bench") as run,
    ):
        for i in range(n):
            start = time.perf_counter()
            await run.call(mark, i)
            whole.append(time.perf_counter() - start)
            before_dispatch.append(dispatched[-1] - start)
    return whole, before_dispatch


async def one_call_runs(url: str, n: int) -> list[float]:
    """Whole one-call runs, one after another: the run created, one gated call, the run
    ended (its end and the call's outcome durable when its block is left)."""
    samples = []
    async with stopline.open(url) as ledger:
        for i in range(n):
            start = time.perf_counter()
            async with ledger.run("bench", owner="bench") as run:
                await run.call(_noop, i)
            samples.append(time.perf_counter() - start)
    return samples


def one_call_run_figure(engine: str, runs: list[float], bare: float, bare_is: str) -> Figure:
    """``run_one_call_<engine>_us``: a one-call run's p50 beside ``bare`` (seconds, this
    run's), which ``bare_is``."""
    return Figure(
        f"run_one_call_{engine}_us",
        median(runs) * 1e6,
        "us",
        bare * 1e6,
        "",
        "p50 of a run opened, one gated call, the run ended; its floor is three durable "
        f"writes (the run, the call's intent, the run's end with the call's outcome); "
        f"baseline: {bare_is}",
    )


async def wal_pages(workdir: Path, calls: int = 40) -> tuple[float, float]:
    """Pages written to the WAL per transaction: a sequential gated call's (its intent
    with the previous call's outcome), and a bare fence check + insert's (ADR 0035)."""
    counted = calls // 2
    gated = workdir / "pages.db"
    async with (
        stopline.open(f"sqlite:///{gated}") as ledger,
        ledger.run("bench", owner="bench") as run,
    ):
        for i in range(calls):
            await run.call(_noop, i)
        ours = last_commits(gated, counted)
    bare = workdir / "pages_bare.db"
    async with bare_txn(bare) as once:
        for _ in range(calls):
            await once()
        theirs = last_commits(bare, counted)
    return _per_commit(ours), _per_commit(theirs)


def _per_commit(commits: list[list[int]]) -> float:
    return sum(map(len, commits)) / len(commits)


@dataclasses.dataclass(frozen=True)
class Throughput:
    """Operations per second, and the CPU each took: on the event loop's thread, and in
    the rest of the process (the writer thread, and the cancel watcher's polls)."""

    ops_per_s: float
    loop_us: float
    rest_us: float

    def words(self) -> str:
        return f"event loop {self.loop_us:.0f} us, writer thread and the rest {self.rest_us:.0f} us"


@contextlib.contextmanager
def _timed(ops: int, out: list[Throughput]) -> Iterator[None]:
    """Time ``ops`` operations run inside the block, on the event loop's thread."""
    wall, loop, process = time.perf_counter(), time.thread_time(), time.process_time()
    yield
    wall, loop = time.perf_counter() - wall, time.thread_time() - loop
    process = time.process_time() - process
    out.append(Throughput(ops / wall, loop / ops * 1e6, max(0.0, process - loop) / ops * 1e6))


async def _concurrent(url: str, runs: int, per_run: int) -> Throughput:
    measured: list[Throughput] = []
    async with stopline.open(url) as ledger:

        async def one() -> None:
            async with ledger.run("bench", owner="bench") as run:
                for i in range(per_run):
                    await run.call(_noop, i)

        with _timed(runs * per_run, measured):
            async with anyio.create_task_group() as tg:
                for _ in range(runs):
                    tg.start_soon(one)
    return measured[0]


async def _bare_concurrent(path: Path, workers: int, per_worker: int) -> Throughput:
    backend = await SQLiteBackend.open(path)
    try:

        def setup(conn: sqlite3.Connection) -> None:
            conn.execute("CREATE TABLE IF NOT EXISTS bare_ops2 (id TEXT PRIMARY KEY)")

        await backend.transact(setup)

        async def one() -> None:
            for _ in range(per_worker * 2):  # intent and outcome: two writes per operation
                op_id = uuid.uuid4().hex
                await backend.transact(functools.partial(_insert_bare, op_id=op_id))

        measured: list[Throughput] = []
        with _timed(workers * per_worker, measured):
            async with anyio.create_task_group() as tg:
                for _ in range(workers):
                    tg.start_soon(one)
    finally:
        await backend.close()
    return measured[0]


def _insert_bare(conn: sqlite3.Connection, op_id: str) -> None:
    conn.execute("INSERT INTO bare_ops2 VALUES (?)", (op_id,))


BUSY = 20  # the other runs of a busy process, each calling back to back


async def _cancel_latencies(url: str, n: int) -> list[float]:
    async with stopline.open(url) as ledger:
        with quiet_heap():
            return [await _one_cancel(ledger) for _ in range(n)]


async def _one_cancel(ledger: stopline.Ledger) -> float:
    """cancel() -> fence durable -> the in-flight call's scope cancelled."""
    in_call = anyio.Event()
    marks: dict[str, float] = {}
    ids: list[str] = []

    @stopline.tool
    async def wait(ctx: stopline.CallContext) -> None:
        in_call.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            marks["interrupted"] = time.perf_counter()
            raise

    async def workflow() -> None:
        async with ledger.run("bench", owner="bench") as run:
            ids.append(run.id)
            async with run.phase(stopline.PhaseKind.READING, stopline.Policy.IMMEDIATE):
                await run.call(wait)

    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow)
        await in_call.wait()
        start = time.perf_counter()
        await ledger.cancel(ids[0], by="bench")
    return marks["interrupted"] - start


async def _busy_cancel_latencies(url: str, n: int, busy: int) -> tuple[list[float], float]:
    """``_one_cancel`` while ``busy`` other runs of the process make gated calls back to
    back: what a cancel waits for in a working process (the writer's queue, the loop).
    Also the calls per second the busy runs made meanwhile."""
    calls = 0
    stop = anyio.Event()

    async def work(ledger: stopline.Ledger) -> None:
        nonlocal calls
        async with ledger.run("busy", owner="bench") as run:
            while not stop.is_set():
                await run.call(_noop, calls)
                calls += 1

    async with stopline.open(url) as ledger, anyio.create_task_group() as tg:
        for _ in range(busy):
            tg.start_soon(work, ledger)
        with quiet_heap():
            start, before = time.perf_counter(), calls
            samples = [await _one_cancel(ledger) for _ in range(n)]
            rate = (calls - before) / (time.perf_counter() - start)
        stop.set()
    return samples, rate


async def _one_task_cancel() -> float:
    started = anyio.Event()
    marks: dict[str, float] = {}

    async def victim() -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            marks["interrupted"] = time.perf_counter()
            raise

    async with anyio.create_task_group() as tg:
        tg.start_soon(victim)
        await started.wait()
        start = time.perf_counter()
        tg.cancel_scope.cancel()
    return marks["interrupted"] - start


async def measure(*, quick: bool, workdir: Path, postgres: str | None = None) -> list[Figure]:
    del postgres
    n = 300 if quick else 3000
    url = f"sqlite:///{workdir / 'core.db'}"
    bare = await bare_txn_samples(workdir / "bare.db", n)
    gated, before_dispatch = await gate_samples(url, n)
    runs_alone = await one_call_runs(f"sqlite:///{workdir / 'runs.db'}", n // 3)
    strict, _ = await gate_samples(f"sqlite:///{workdir / 'strict.db'}", n, durable_outcomes=True)
    runs, per_run = (100, 5) if quick else (100, 50)
    throughput = await _concurrent(f"sqlite:///{workdir / 'concurrent.db'}", runs, per_run)
    bare_throughput = await _bare_concurrent(workdir / "bare2.db", runs, per_run)
    pages, bare_pages = await wal_pages(workdir)
    samples = 3 * P99_MIN_SAMPLES  # in quick mode as in full
    cancels = await _cancel_latencies(f"sqlite:///{workdir / 'cancel.db'}", samples)
    busy, rate = await _busy_cancel_latencies(f"sqlite:///{workdir / 'busy.db'}", samples, BUSY)
    with quiet_heap():
        task_cancels = [await _one_task_cancel() for _ in range(samples)]
    idle_p99 = percentile(cancels, 99) * 1e3
    return [
        Figure(
            "gate_sqlite_us",
            median(gated) * 1e6,
            "us",
            median(bare) * 1e6,
            "ratio <= 1.3",
            "p50 gated call (intent durable, outcome riding the next group commit) vs one "
            "bare fence-check+insert txn",
        ),
        Figure(
            "gate_sqlite_strict_us",
            median(strict) * 1e6,
            "us",
            median(bare) * 1e6,
            "",
            "the same with durable_outcomes=True: the call returns once its outcome is durable",
        ),
        Figure(
            "gate_dispatch_sqlite_us",
            median(before_dispatch) * 1e6,
            "us",
            median(bare) * 1e6,
            "ratio ~ 1.0",
            "p50 from run.call() to the provider invoked: the gate's one durable write",
        ),
        one_call_run_figure("sqlite", runs_alone, median(bare), "one bare durable txn"),
        Figure(
            "gate_sqlite_wal_pages",
            pages,
            "pages",
            bare_pages,
            "",
            "pages a sequential gated call's transaction writes to the WAL (counted, not "
            "timed) vs a bare fence-check+insert txn's",
        ),
        Figure(
            "gate_sqlite_concurrent_ops_per_s",
            throughput.ops_per_s,
            "ops/s",
            bare_throughput.ops_per_s,
            ">= 20000",
            f"{runs} concurrent runs; baseline: bare inserts, 2 per op; CPU per op: "
            f"{throughput.words()} (bare: {bare_throughput.words()})",
        ),
        Figure(
            "cancel_inprocess_p99_ms",
            idle_p99,
            "ms",
            percentile(task_cancels, 99) * 1e3,
            "<= 1.0 ms",
            f"cancel() to in-flight scope cancelled, fence durable first (p99 of {len(cancels)}; "
            f"p50 {median(cancels) * 1e3:.2f} ms); baseline: bare task cancel; the floor, one "
            "bare durable txn here: "
            f"p50 {percentile(bare, 50) * 1e3:.2f} ms, p99 {percentile(bare, 99) * 1e3:.2f} ms",
        ),
        Figure(
            "cancel_inprocess_busy_p99_ms",
            percentile(busy, 99) * 1e3,
            "ms",
            idle_p99,  # the figure above: the same cancel, the process otherwise idle
            "",
            f"the same cancel while {BUSY} other runs of the process make gated calls back "
            f"to back ({rate:,.0f} calls/s meanwhile); p50 {median(busy) * 1e3:.2f} ms; "
            "baseline: cancel_inprocess_p99_ms, the process otherwise idle",
        ),
    ]
