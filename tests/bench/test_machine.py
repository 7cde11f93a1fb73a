"""The machine's share in a run: CPU time the hypervisor stole, per suite and whole."""

from __future__ import annotations

from pathlib import Path

import anyio

from stopline.bench import Figure, run_suites, steal_figure, with_steal
from stopline.bench.machine import CpuTimes, cpu_times

# /proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice
_BEFORE = "cpu  100 0 50 800 10 0 5 35 7 0\ncpu0 50 0 25 400 5 0 3 17 0 0\n"
_AFTER = "cpu  200 0 100 1000 10 0 5 185 9 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"


def _stat(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_steal_share_is_read_from_the_first_line_of_proc_stat(tmp_path: Path) -> None:
    before = cpu_times(_stat(tmp_path, "before", _BEFORE))
    after = cpu_times(_stat(tmp_path, "after", _AFTER))
    assert before == CpuTimes(total=1000, steal=35)  # guest time is in user already
    assert after is not None
    assert before.steal_share(after) == 150 / 500
    assert after.steal_share(after) is None  # no time passed: nothing to say


def test_a_stat_file_missing_or_not_as_known_says_nothing(tmp_path: Path) -> None:
    assert cpu_times(tmp_path / "absent") is None
    assert cpu_times(_stat(tmp_path, "empty", "")) is None
    assert cpu_times(_stat(tmp_path, "short", "cpu 1 2 3\n")) is None
    assert cpu_times(_stat(tmp_path, "other", "intr 1 2 3 4 5 6 7 8 9\n")) is None
    assert cpu_times(_stat(tmp_path, "words", "cpu a b c d e f g h\n")) is None


def test_each_figure_says_what_was_stolen_during_its_suite_and_the_run_its_own() -> None:
    before, after = CpuTimes(1000, 35), CpuTimes(1500, 185)
    figures = [Figure("gate_sqlite_us", 500.0, "us", 400.0, note="p50"), Figure("x", 1.0, "s")]
    noted = with_steal(figures, before, after)
    assert [f.note for f in noted] == [
        "p50; CPU stolen by the hypervisor during its suite: 30%",
        "CPU stolen by the hypervisor during its suite: 30%",
    ]
    assert [(f.value, f.baseline) for f in noted] == [(500.0, 400.0), (1.0, None)]
    whole = steal_figure(before, after)
    assert whole is not None
    assert (whole.name, whole.value, whole.unit, whole.baseline) == (
        "machine_cpu_steal_pct",
        30.0,
        "%",
        None,
    )
    assert with_steal(figures, None, after) == figures  # not Linux: nothing said
    assert steal_figure(before, None) is None


def test_a_run_on_this_machine_reports_its_steal(tmp_path: Path) -> None:
    """On Linux (CI included) the run's own figure is there, and every suite's figure
    carries its share."""
    figures = anyio.run(lambda: run_suites(quick=True, workdir=tmp_path, only=("truth",)))
    *ours, machine = figures
    assert ours
    assert all("CPU stolen by the hypervisor during its suite" in f.note for f in ours)
    assert machine.name == "machine_cpu_steal_pct"
    assert 0.0 <= machine.value <= 100.0
