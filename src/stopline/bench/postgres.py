"""PostgreSQL figures: the gate's cost, cross-process cancel latency, many-worker throughput.

``stopline bench --postgres URL`` runs them in a schema of their own on that
server (dropped afterwards); without a URL this suite measures nothing.
Baselines are measured on the same server in the same run: a bare
conditional insert (the fence check and the insert as one statement, on one
connection), the floor for any gate that records its intent durably first.
Worker processes are real processes (``python -m stopline.bench.postgres``);
times across them are read from the system-wide monotonic clock
(``time.perf_counter`` on Linux).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import anyio
import anyio.to_thread
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

import stopline
from stopline.bench.core import one_call_run_figure, one_call_runs
from stopline.bench.figures import P99_MIN_SAMPLES, Figure, median, percentile
from stopline.domain.model import OperationSpec
from stopline.ledger.backend import RunSpec

__all__ = ["measure", "with_schema"]


@stopline.tool
async def _noop(ctx: stopline.CallContext, n: int) -> int:
    return n


def with_schema(url: str, schema: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}schema={schema}"


# -- the gate vs a bare conditional insert --------------------------------------------
async def _bare_samples(url: str, schema: str, n: int) -> tuple[list[float], float]:
    """(each bare insert's time, this process's CPU seconds per insert)."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await conn.execute(f'SET search_path = "{schema}"')
        await conn.execute("CREATE TABLE bare_fence (id TEXT PRIMARY KEY, fence INT)")
        await conn.execute("CREATE TABLE bare_ops (id TEXT PRIMARY KEY, run TEXT)")
        await conn.execute("INSERT INTO bare_fence VALUES ('r', 0)")
        samples = []
        cpu = time.process_time()
        for _ in range(n):
            op_id = uuid.uuid4().hex
            start = time.perf_counter()
            await conn.execute(
                "INSERT INTO bare_ops SELECT %s, id FROM bare_fence WHERE id = 'r' AND fence = 0",
                (op_id,),
            )
            samples.append(time.perf_counter() - start)
        cpu = (time.process_time() - cpu) / n
    return samples, cpu


async def _gate_samples(url: str, n: int) -> tuple[list[float], list[float], float]:
    """(whole gated operations: intent + outcome, the gate alone, this process's CPU
    seconds per gate)."""
    calls, gates = [], []
    async with stopline.open(url) as ledger, ledger.run("bench", owner="bench") as run:
        for i in range(n):
            start = time.perf_counter()
            await run.call(_noop, i)
            calls.append(time.perf_counter() - start)
        spec = RunSpec("bench_gate", "bench", "bench", "bench")
        await ledger.backend.create_run(spec)
        ops = [_gate_spec(i) for i in range(n)]
        cpu = time.process_time()
        for op in ops:
            start = time.perf_counter()
            await ledger.backend.gate(op)
            gates.append(time.perf_counter() - start)
        cpu = (time.process_time() - cpu) / n
    return calls, gates, cpu


def _gate_spec(i: int) -> OperationSpec:
    return OperationSpec(
        f"bench_gate/{i}", "bench_gate", "noop", "d", "", stopline.Cancellable.NEVER, False, False
    )


# -- cancel across processes ----------------------------------------------------------
# Worker processes are ``python -m stopline.bench.postgres ROLE ...``: lines on stdout
# report to the bench, a line on stdin lets a worker go.
def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _victim_main(url: str, n: int) -> None:
    marks: dict[str, float] = {}

    @stopline.tool
    async def wait(ctx: stopline.CallContext) -> None:
        _say("in")
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            marks["interrupted"] = time.perf_counter()
            raise

    async with stopline.open(url) as ledger:
        for i in range(n):
            async with (
                ledger.run("victim", owner="bench", run_id=f"victim_{i}") as run,
                run.phase(stopline.PhaseKind.READING, stopline.Policy.IMMEDIATE),
            ):
                await run.call(wait)
            _say(repr(marks["interrupted"]))


class _Child:
    """A worker process and its stdout, line by line."""

    def __init__(self, proc: Process) -> None:
        self.proc = proc
        assert proc.stdout is not None
        self._lines = BufferedByteReceiveStream(proc.stdout)

    @classmethod
    async def start(cls, *args: str) -> _Child:
        cmd = [sys.executable, "-m", "stopline.bench.postgres", *args]
        return cls(await anyio.open_process(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE))

    async def line(self) -> str:
        return (await self._lines.receive_until(b"\n", 4096)).decode()

    async def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send(line.encode() + b"\n")

    async def close(self) -> None:
        with anyio.move_on_after(60, shield=True):
            await self.proc.wait()
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.aclose()


async def _cross_process_cancels(url: str, n: int) -> tuple[list[float], list[float], list[float]]:
    """``cancel()`` to the interruption in the victim, and the cancel's own transaction
    (what of it is the canceller's commit, the rest is the notification's way), and
    the canceller's idle time before each (the victim starting its next call)."""
    child = await _Child.start("victim", url, str(n))
    samples, txns, idle = [], [], []
    try:
        async with stopline.open(url) as ledger:
            for i in range(n):
                ended = time.perf_counter()
                assert await child.line() == "in"
                start = time.perf_counter()  # before the cancel's transaction starts
                idle.append(start - ended)
                await ledger.backend.cancel(f"victim_{i}", by="bench")
                txns.append(time.perf_counter() - start)
                samples.append(float(await child.line()) - start)
    finally:
        await child.close()
    return samples, txns, idle


async def _listener_main(url: str, n: int) -> None:
    """The floor of the cross-process figure: a bare ``LISTEN`` connection, no ledger."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("LISTEN stopline_bench_floor")
        for _ in range(n):
            _say("in")
            async for _note in conn.notifies(stop_after=1):
                _say(repr(time.perf_counter()))


async def _bare_notifies(
    url: str, schema: str, n: int, idle: float
) -> tuple[list[float], list[float]]:
    """The floors of the cross-process figure, to the moment a listening process has the
    notification, at the cancels' cadence, alternating: a bare ``NOTIFY`` (one
    autocommit statement: the way between two processes), and a bare fence (a row's
    counter raised and a ``NOTIFY``, committed durably in one round trip: what any
    durable cancel seen from another process costs here). Each after ``idle`` seconds
    of quiet, as the cancels had: a connection and a server process gone idle answer
    slower on this kind of machine."""
    import psycopg

    child = await _Child.start("listener", url, str(2 * n))
    bare: list[float] = []
    durable: list[float] = []
    fence = (
        "UPDATE bare_fence SET fence = fence + 1 WHERE id = 'floor'",
        "NOTIFY stopline_bench_floor",
    )
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(f'SET search_path = "{schema}"')
            await conn.execute("INSERT INTO bare_fence VALUES ('floor', 0)")

            async def notify() -> None:
                await conn.execute("NOTIFY stopline_bench_floor")

            async def commit_fence() -> None:
                async with conn.pipeline():  # one round trip, as a childless run's cancel
                    await conn.execute("BEGIN")
                    for statement in fence:
                        await conn.execute(statement)
                    await conn.execute("COMMIT")

            for _ in range(n):
                for act, samples in ((notify, bare), (commit_fence, durable)):
                    assert await child.line() == "in"
                    await anyio.sleep(idle)
                    start = time.perf_counter()
                    await act()
                    samples.append(float(await child.line()) - start)
    finally:
        await child.close()
    return bare, durable


# -- many workers ---------------------------------------------------------------------
async def _worker_main(url: str, runs: int, per_run: int) -> None:
    async with stopline.open(url + "&pool_max=20") as ledger:
        _say("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)

        async def one() -> None:
            async with ledger.run("bench", owner="bench") as run:
                for i in range(per_run):
                    await run.call(_noop, i)

        cpu = time.process_time()
        async with anyio.create_task_group() as tg:
            for _ in range(runs):
                tg.start_soon(one)
        _say(f"done {time.process_time() - cpu:.6f}")  # this worker's CPU seconds


def _postgres_cpu_seconds() -> float | None:
    """CPU seconds used so far by this host's postgres processes (None without /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    found = False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "postgres":
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found = True
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / ticks if found else None


@dataclasses.dataclass(frozen=True)
class _Workers:
    """Operations per second of the worker processes, the CPU each operation took in
    them (their own clock, start-up excluded), and the server's share of the cores."""

    ops_per_s: float
    client_us: float
    server_share: float | None


async def _concurrent(url: str, procs: int, runs: int, per_run: int) -> _Workers:
    children = [await _Child.start("worker", url, str(runs), str(per_run)) for _ in range(procs)]
    client_cpu = 0.0
    try:
        for child in children:
            assert await child.line() == "ready"
        cpu_before = _postgres_cpu_seconds()
        start = time.perf_counter()
        for child in children:
            await child.send("go")
        for child in children:
            said, cpu = (await child.line()).split()
            assert said == "done"
            client_cpu += float(cpu)
        elapsed = time.perf_counter() - start
        cpu_after = _postgres_cpu_seconds()
    finally:
        for child in children:
            await child.close()
    share = None
    if cpu_before is not None and cpu_after is not None:
        share = (cpu_after - cpu_before) / elapsed / (os.cpu_count() or 1)
    ops = procs * runs * per_run
    return _Workers(ops / elapsed, client_cpu / ops * 1e6, share)


async def measure(*, quick: bool, workdir: Path, postgres: str | None = None) -> list[Figure]:
    del workdir
    if postgres is None:
        return []
    import psycopg

    schema = f"stopline_bench_{uuid.uuid4().hex[:12]}"
    url = with_schema(postgres, schema)
    n = 300 if quick else 3000
    try:
        bare, bare_cpu = await _bare_samples(postgres, f"{schema}_bare", n)
        calls, gates, gate_cpu = await _gate_samples(url, n)
        runs_alone = await one_call_runs(url, n // 3)
        samples = P99_MIN_SAMPLES if quick else 2 * P99_MIN_SAMPLES
        cancels, cancel_txns, idle = await _cross_process_cancels(url, samples)
        floor, durable = await _bare_notifies(postgres, f"{schema}_bare", samples, median(idle))
        per_run = 10 if quick else 50
        workers = await _concurrent(url, 4, 50, per_run)
    finally:
        async with await psycopg.AsyncConnection.connect(postgres, autocommit=True) as conn:
            for name in (schema, f"{schema}_bare"):
                await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    share = workers.server_share
    cpu = "n/a" if share is None else f"{share:.0%} of {os.cpu_count()} cores"
    return [
        Figure(
            "gate_postgres_us",
            median(gates) * 1e6,
            "us",
            median(bare) * 1e6,
            "ratio <= 1.3",
            "p50 gate (fence check + intent + event, one statement) vs one bare conditional "
            f"insert; a whole gated call (intent + outcome) p50 {median(calls) * 1e6:.0f} us; "
            f"client CPU per gate {gate_cpu * 1e6:.0f} us, per bare insert "
            f"{bare_cpu * 1e6:.0f} us",
        ),
        one_call_run_figure("postgres", runs_alone, median(bare), "one bare conditional insert"),
        Figure(
            "cancel_cross_process_p99_ms",
            percentile(cancels, 99) * 1e3,
            "ms",
            percentile(durable, 99) * 1e3,
            "<= 2 ms",
            "cancel() started in one process to the in-flight call's scope cancelled in "
            f"another (LISTEN/NOTIFY; p99 of {len(cancels)}); p50 "
            f"{median(cancels) * 1e3:.2f} ms, of which the cancel's own transaction p50 "
            f"{median(cancel_txns) * 1e3:.2f} ms, each after "
            f"{median(idle) * 1e3:.1f} ms idle (p50); after as long idle, a bare NOTIFY "
            f"to a listening process: p50 {median(floor) * 1e3:.2f}, "
            f"p99 {percentile(floor, 99) * 1e3:.2f} ms; baseline: a bare fence (a counter "
            "raised and a NOTIFY, committed in one round trip) to the listening process, "
            f"p99 (p50 {median(durable) * 1e3:.2f} ms)",
        ),
        Figure(
            "gate_postgres_concurrent_ops_per_s",
            workers.ops_per_s,
            "ops/s",
            None,
            ">= 5,000/s",
            f"4 worker processes x 50 concurrent runs, intent + outcome per op; server CPU "
            f"{cpu}; the workers' CPU per op {workers.client_us:.0f} us",
        ),
    ]


def _child_main(argv: list[str]) -> None:
    role, url, *rest = argv
    if role == "victim":
        anyio.run(_victim_main, url, int(rest[0]))
    elif role == "listener":
        anyio.run(_listener_main, url, int(rest[0]))
    else:
        anyio.run(_worker_main, url, int(rest[0]), int(rest[1]))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
