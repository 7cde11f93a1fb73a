"""`stopline bench`: each figure measured beside its baseline in the same run.

Machines are shared and noisy, so absolute numbers move; the ratio to a
baseline measured moments earlier on the same machine is what we compare.
Each suite module exposes ``async def measure(quick: bool, **options) ->
list[Figure]``; this module runs them, prints a table and writes JSON
``{name: {"value", "unit", "baseline", "ratio", "target", "note"}}``.
Each figure's note ends with the share of CPU time the hypervisor stole while
its suite ran, and ``machine_cpu_steal_pct`` is the whole run's (``machine``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from stopline.bench.figures import Figure
from stopline.bench.machine import CpuTimes, cpu_times
from stopline.bench.options import check_installed, check_json_path, check_server
from stopline.errors import InvalidInput

__all__ = ["SUITES", "Figure", "main", "median_round", "run_suites", "steal_figure", "with_steal"]

# module name under stopline.bench -> the options it takes
SUITES: tuple[str, ...] = ("core", "lifecycle", "truth", "mcp", "postgres", "engines")


async def run_suites(
    *, quick: bool, workdir: Path, postgres: str | None = None, only: tuple[str, ...] = SUITES
) -> list[Figure]:
    from stopline.cli.progress import progress

    figures: list[Figure] = []
    first = cpu_times()
    with progress("benchmarks", total=len(only)) as bar:
        for name in only:
            bar.describe(f"bench: {name}")
            module = importlib.import_module(f"stopline.bench.{name}")
            measure: Callable[..., Awaitable[list[Figure]]] = module.measure
            before = cpu_times()
            measured = await measure(quick=quick, workdir=workdir, postgres=postgres)
            figures.extend(with_steal(measured, before, cpu_times()))
            bar.advance()
    whole = steal_figure(first, cpu_times())
    return figures if whole is None else [*figures, whole]


def _share(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    return None if before is None or after is None else before.steal_share(after)


def with_steal(
    figures: list[Figure], before: CpuTimes | None, after: CpuTimes | None
) -> list[Figure]:
    """The figures of one suite, each note ending with the CPU time stolen meanwhile."""
    share = _share(before, after)
    if share is None:
        return figures
    said = f"CPU stolen by the hypervisor during its suite: {share:.0%}"
    return [dataclasses.replace(f, note=f"{f.note}; {said}".lstrip("; ")) for f in figures]


def steal_figure(before: CpuTimes | None, after: CpuTimes | None) -> Figure | None:
    """The whole run's stolen share as a figure of its own (no target: the machine's)."""
    share = _share(before, after)
    if share is None:
        return None
    return Figure(
        "machine_cpu_steal_pct",
        share * 100,
        "%",
        note="share of all cores' CPU time the hypervisor took while the benchmarks ran "
        "(/proc/stat); high: absolute figures of this run are the machine's, not ours",
    )


def main(
    *,
    quick: bool = False,
    json_path: str | None = None,
    postgres: str | None = None,
    peers: bool = False,
    rounds: int = 1,
) -> int:
    """Run the benchmarks, print a table, optionally write JSON; return the exit code.

    ``peers``: also DBOS, Temporal and bare sqlite3 doing the same no-op effect
    (``stopline[bench-peers]``), and our latencies as ratios to theirs.
    ``rounds``: run everything that many times and keep, per figure, the round
    whose same-run ratio is the median (``median_round``).
    """
    if rounds < 1:
        raise InvalidInput("rounds", f"{rounds}: must be at least 1")
    json_file = check_json_path(json_path) if json_path else None
    if postgres:
        check_server(postgres)
    only = (*SUITES, "peers") if peers else SUITES
    check_installed(only)
    runs: list[list[Figure]] = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="stopline-bench-") as tmp:
            runs.append(anyio.run(_run, quick, Path(tmp), postgres, only))
    figures = median_round(runs)
    out: dict[str, Any] = {f.name: f.to_json() for f in figures}
    width = max(len(f.name) for f in figures)
    print(f"{'figure':<{width}}  {'value':>12} {'unit':<6} {'baseline':>12}  {'ratio':>7}  target")
    for f in figures:
        print(f.row(width))
    for line in _versus_peers(figures):
        print(line)
    if json_file:
        json_file.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {json_path}", file=sys.stderr)
    return 0


async def _run(
    quick: bool, workdir: Path, postgres: str | None, only: tuple[str, ...]
) -> list[Figure]:
    return await run_suites(quick=quick, workdir=workdir, postgres=postgres, only=only)


def median_round(runs: list[list[Figure]]) -> list[Figure]:
    """Per figure, the round whose ratio (its value, without a baseline) is the median
    (the lower one of an even count): a value and its baseline always come from one
    round, so the ratio stays a same-run ratio. Figures in the order of the first round."""
    if len(runs) == 1:
        return runs[0]
    by_name: dict[str, list[Figure]] = {}
    for figures in runs:
        for figure in figures:
            by_name.setdefault(figure.name, []).append(figure)
    out = []
    for rounds in by_name.values():
        ranked = sorted(rounds, key=lambda f: f.value if f.ratio is None else f.ratio)
        chosen = ranked[(len(ranked) - 1) // 2]
        note = f"{chosen.note}; median of {len(rounds)} rounds".lstrip("; ")
        out.append(dataclasses.replace(chosen, note=note))
    return out


def _versus_peers(figures: list[Figure]) -> list[str]:
    """Each of our latencies (µs) as a ratio to each peer's, all from this run."""
    peers = [f for f in figures if f.name.startswith("peer_")]
    ours = [f for f in figures if f.unit == "us" and not f.name.startswith("peer_")]
    if not peers:
        return []
    lines = ["", "ours / peer (same run; < 1 means we are faster)"]
    for mine in ours:
        ratios = ", ".join(f"{p.name} {mine.value / p.value:.2f}" for p in peers if p.value)
        lines.append(f"  {mine.name}: {ratios}")
    return lines
