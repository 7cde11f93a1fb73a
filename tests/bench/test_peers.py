"""`stopline bench --peers`: DBOS, Temporal and bare sqlite3 measured in the same run.

Timings are never asserted: these check that every peer really ran the no-op
effect and that each figure keeps the bench's JSON shape, beside our own call.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stopline.bench import _versus_peers, median_round
from stopline.bench import main as bench_main
from stopline.bench.figures import Figure
from stopline.bench.peers import measure
from tests.postgres.server import require_server


@pytest.mark.timeout(300)
async def test_every_peer_runs_beside_our_call(tmp_path: Path) -> None:
    figures = await measure(quick=True, workdir=tmp_path, postgres=require_server())
    names = [f.name for f in figures]
    assert names == [
        "peer_sqlite3_txn_us",
        "peer_dbos_step_sqlite_us",
        "peer_temporal_activity_us",
        "peer_dbos_step_postgres_us",
    ]
    for figure in figures:
        shape = figure.to_json()
        assert set(shape) >= {"value", "unit", "baseline", "ratio"}
        assert shape["value"] > 0 and shape["baseline"] > 0  # ours, measured in this run
        assert figure.baseline is not None
        assert shape["ratio"] == pytest.approx(figure.value / figure.baseline, rel=1e-2)


def test_our_latencies_are_printed_as_ratios_to_each_peer() -> None:
    figures = [
        Figure("gate_sqlite_us", 200.0, "us", 100.0),
        Figure("gate_sqlite_concurrent_ops_per_s", 9000.0, "ops/s"),
        Figure("peer_dbos_step_sqlite_us", 2000.0, "us", 200.0),
        Figure("peer_sqlite3_txn_us", 100.0, "us", 200.0),
    ]
    lines = _versus_peers(figures)
    assert lines[-1] == "  gate_sqlite_us: peer_dbos_step_sqlite_us 0.10, peer_sqlite3_txn_us 2.00"
    assert not any("concurrent" in line for line in lines)  # a throughput is not a latency
    assert _versus_peers(figures[:2]) == []  # without --peers, nothing extra


def test_rounds_keep_the_median_round_of_each_figure_whole() -> None:
    """With --rounds, each figure is one round's value and baseline (a same-run ratio),
    the round whose ratio is the median; a figure without a baseline by its value."""
    rounds = [
        [Figure("gate_sqlite_us", 300.0, "us", 100.0), Figure("ops", 10.0, "ops/s")],
        [Figure("gate_sqlite_us", 500.0, "us", 400.0), Figure("ops", 30.0, "ops/s")],
        [Figure("gate_sqlite_us", 200.0, "us", 100.0), Figure("ops", 20.0, "ops/s")],
    ]
    gate, ops = median_round(rounds)
    assert (gate.value, gate.baseline) == (200.0, 100.0)  # ratios 3.0, 1.25, 2.0: 2.0
    assert (ops.value, ops.baseline) == (20.0, None)
    assert gate.note.endswith("median of 3 rounds")
    assert median_round(rounds[:1]) == rounds[0]  # one round: as measured
    # an even count keeps the lower of the two middle rounds
    assert median_round(rounds[:2])[0].ratio == 1.25


def test_rounds_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        bench_main(quick=True, rounds=0)
