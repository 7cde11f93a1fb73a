"""The core bench: every figure beside its same-run baseline, and the counted one (WAL pages)."""

from __future__ import annotations

import re
from pathlib import Path

from stopline.bench.core import measure, wal_pages
from stopline.bench.figures import P99_MIN_SAMPLES


async def test_wal_pages_counts_a_call_and_a_bare_transaction(tmp_path: Path) -> None:
    ours, bare = await wal_pages(tmp_path)
    # the bare transaction: its table's leaf and its key's index leaf, and the header
    # page now and then as the file grows
    assert 2 <= bare < 2.5
    # a call: the operation and its three indexes, the log and its index (ADR 0035)
    assert 6 <= ours < 8


async def test_the_core_figures_each_have_a_same_run_baseline_and_the_cancel_its_floor(
    tmp_path: Path,
) -> None:
    """Every core figure is measured beside its baseline; the in-process cancel's note
    gives the floor under it, one bare durable transaction's p50 and p99 from the same
    run (the fence is durable before anything is interrupted)."""
    figures = {f.name: f for f in await measure(quick=True, workdir=tmp_path)}
    assert set(figures) == {
        "gate_sqlite_us",
        "gate_sqlite_strict_us",
        "gate_dispatch_sqlite_us",
        "run_one_call_sqlite_us",
        "gate_sqlite_wal_pages",
        "gate_sqlite_concurrent_ops_per_s",
        "cancel_inprocess_p99_ms",
        "cancel_inprocess_busy_p99_ms",
    }
    assert all(f.value > 0 and f.baseline for f in figures.values())
    split = re.search(
        r"CPU per op: event loop (\d+) us, writer thread and the rest (\d+) us \(bare: ",
        figures["gate_sqlite_concurrent_ops_per_s"].note,
    )
    assert split is not None and int(split[1]) > 0
    # a p99 of fewer than P99_MIN_SAMPLES is their maximum: quick mode takes enough
    cancel = figures["cancel_inprocess_p99_ms"]
    taken = re.search(r"\(p99 of (\d+); p50 ([\d.]+) ms\)", cancel.note)
    assert taken is not None and int(taken[1]) >= P99_MIN_SAMPLES
    assert 0 < float(taken[2]) <= cancel.value  # ours at p50, beside the p99 and the floor
    floor = re.search(r"p50 ([\d.]+) ms, p99 ([\d.]+) ms$", figures["cancel_inprocess_p99_ms"].note)
    assert floor is not None
    assert 0 < float(floor[1]) <= float(floor[2])
    # the same cancel in a busy process: the others' calls went on meanwhile, and its
    # baseline is the idle figure of this run
    busy = figures["cancel_inprocess_busy_p99_ms"]
    assert busy.baseline == cancel.value
    meanwhile = re.search(r"\(([\d,]+) calls/s meanwhile\); p50 ([\d.]+) ms", busy.note)
    assert meanwhile is not None and int(meanwhile[1].replace(",", "")) > 0
    assert 0 < float(meanwhile[2]) <= busy.value
