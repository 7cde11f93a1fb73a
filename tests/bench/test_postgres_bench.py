"""`stopline bench --postgres`: the gate, the cross-process cancel and the workers.

Timings are never asserted: this checks that every figure is measured on the
real server (a victim process cancelled from this one, worker processes
committing), in the bench's JSON shape, and that the bench leaves no schema.
"""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest

from stopline.bench.figures import P99_MIN_SAMPLES
from stopline.bench.postgres import measure
from tests.postgres.server import require_server


def bench_schemas(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'stopline_bench_%'"
        ).fetchall()
    return {str(name) for (name,) in rows}


@pytest.mark.timeout(300)
async def test_the_postgres_figures_are_measured_on_the_server(tmp_path: Path) -> None:
    url = require_server()
    before = bench_schemas(url)
    figures = {f.name: f for f in await measure(quick=True, workdir=tmp_path, postgres=url)}
    assert list(figures) == [
        "gate_postgres_us",
        "run_one_call_postgres_us",
        "cancel_cross_process_p99_ms",
        "gate_postgres_concurrent_ops_per_s",
    ]
    for figure in figures.values():
        assert set(figure.to_json()) >= {"value", "unit", "baseline", "ratio"}
        assert figure.value > 0
    gate = figures["gate_postgres_us"]
    assert gate.baseline is not None and gate.baseline > 0  # the bare insert, this run
    # the client's own share of each: CPU seconds of this process per gate, per insert
    cpu = re.search(r"client CPU per gate (\d+) us, per bare insert (\d+) us", gate.note)
    assert cpu is not None, gate.note
    assert int(cpu[1]) > 0 and int(cpu[2]) > 0
    # where the cancel's time goes: the whole way, and the canceller's transaction in it
    cancel = figures["cancel_cross_process_p99_ms"].note
    found = re.search(
        r"p50 ([\d.]+) ms, of which the cancel's own transaction p50 ([\d.]+)", cancel
    )
    assert found is not None, cancel
    assert float(found[1]) > 0 and float(found[2]) > 0
    taken = re.search(r"p99 of (\d+)\)", cancel)  # quick mode too: a p99, not a maximum
    assert taken is not None and int(taken[1]) >= P99_MIN_SAMPLES
    # and its floor in the same run: a bare NOTIFY to another listening process
    floor = re.search(
        r"a bare NOTIFY to a listening process: p50 ([\d.]+), p99 ([\d.]+) ms", cancel
    )
    assert floor is not None, cancel
    assert 0 < float(floor[1]) <= float(floor[2])
    # and the floor of any durable cancel: a bare fence and NOTIFY, one round trip, whose
    # p99 is the figure's baseline
    durable = re.search(r"round trip\) to the listening process, p99 \(p50 ([\d.]+) ms\)", cancel)
    assert durable is not None, cancel
    baseline = figures["cancel_cross_process_p99_ms"].baseline
    assert baseline is not None and 0 < float(durable[1]) <= baseline
    # what the throughput stands on: the server's share of the cores, the workers' CPU
    workers = figures["gate_postgres_concurrent_ops_per_s"].note
    found = re.search(r"server CPU (\d+)% of \d+ cores; the workers' CPU per op (\d+) us", workers)
    assert found is not None, workers
    assert int(found[2]) > 0
    assert bench_schemas(url) == before  # its two schemas dropped
