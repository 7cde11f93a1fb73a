"""What the machine did to a run: the CPU time its hypervisor took away (steal).

On a shared VM another guest can take the cores for a while: a bare transaction
then costs several times its usual (seen here: 0.34 ms in one run, 1.1 ms with
half the CPU time stolen). Figure and baseline move together, so a same-run
ratio mostly survives; an absolute figure (throughput, a p99) does not. Each
suite's figures carry the share stolen while it ran, and the run reports its
own, so a reader can tell a slow run from a slower stopline.

Read from ``/proc/stat`` (Linux); elsewhere nothing is said.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

__all__ = ["CpuTimes", "cpu_times"]

_STAT = Path("/proc/stat")


@dataclasses.dataclass(frozen=True, slots=True)
class CpuTimes:
    """The machine's CPU time so far, all cores, in clock ticks."""

    total: int
    steal: int

    def steal_share(self, later: CpuTimes) -> float | None:
        """The share of the CPU time from this reading to ``later`` that was stolen."""
        total = later.total - self.total
        if total <= 0:
            return None
        return (later.steal - self.steal) / total


def cpu_times(stat: Path = _STAT) -> CpuTimes | None:
    """Now, from the first line of ``/proc/stat`` (None: not there, or not as known)."""
    try:
        first = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if len(first) < 9 or first[0] != "cpu":
        return None
    try:
        # user nice system idle iowait irq softirq steal [guest guest_nice: already
        # counted in user and nice]
        ticks = [int(value) for value in first[1:9]]
    except ValueError:
        return None
    return CpuTimes(total=sum(ticks), steal=ticks[7])
