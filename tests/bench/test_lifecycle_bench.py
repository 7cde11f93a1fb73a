"""Lifecycle figures: the tree cancel beside bare task cancels; pause and resume."""

from __future__ import annotations

import gc
import re
import time
from pathlib import Path

import stopline
from stopline import OpStatus
from stopline.bench.figures import quiet_heap
from stopline.bench.lifecycle import measure, pause_resume_samples


async def test_the_tree_cancel_says_when_its_fence_was_durable(tmp_path: Path) -> None:
    """The note gives the moment the fence was durable, which comes before the last
    interruption the figure measures (timings are not asserted)."""
    figure, *_ = await measure(quick=True, workdir=tmp_path)
    assert figure.name == "cancel_tree_10k_ms" and figure.baseline
    durable = re.search(r"fence durable at ([\d.]+) ms;", figure.note)
    assert durable is not None
    assert 0 < float(durable[1]) <= figure.value
    # how much of each figure CPython's collector took, ours and the baseline's
    collector = re.search(
        r"collector ran ([\d.]+) ms of the figure \(bare: ([\d.]+) ms\)$", figure.note
    )
    assert collector is not None and float(collector[1]) <= figure.value


async def test_a_quiet_heap_times_the_collections_inside_it() -> None:
    """The collector's spans are kept while the window is open, and only then; a
    stretch of the window is charged only what overlaps it."""
    with quiet_heap() as heap:
        start = time.perf_counter()
        made = [[i] for i in range(50_000)]  # young containers, enough for collections
        gc.collect(0)
        end = time.perf_counter()
    assert heap.spans and heap.collector_s(start, end) > 0
    assert heap.collector_s(end, end + 60) == 0  # nothing after the stretch
    kept = len(heap.spans)
    gc.collect()
    assert len(heap.spans) == kept  # closed: nothing more is charged to it
    del made


async def test_pause_and_resume_are_measured_on_runs_that_pause_and_resume(
    tmp_path: Path,
) -> None:
    """Each round pauses a run of its own, then resumes it to a call waiting at its
    gate: the ledger holds each run's pause and resume, and its call once, committed
    (timings are not asserted)."""
    url = f"sqlite:///{tmp_path / 'pause.db'}"
    pauses, resumes = await pause_resume_samples(url, 5)
    assert len(pauses) == len(resumes) == 5 and min(pauses + resumes) > 0
    async with stopline.open(url) as ledger:
        runs = await ledger.backend.list_runs()
        assert len(runs) == 5
        for run in runs:
            kinds = [e.kind for e in await ledger.backend.events(run.id)]
            (op,) = await ledger.backend.operations(run.id)
            assert kinds.count("pause") == kinds.count("resume") == 1
            assert (op.status, op.attempts) == (OpStatus.COMMITTED, 1)


async def test_the_lifecycle_suite_reports_pause_and_resume_beside_a_durable_txn(
    tmp_path: Path,
) -> None:
    figures = {f.name: f for f in await measure(quick=True, workdir=tmp_path)}
    for name in ("pause_ms", "resume_to_call_ms"):
        assert figures[name].unit == "ms" and figures[name].baseline
        assert "baseline: one bare durable txn" in figures[name].note
