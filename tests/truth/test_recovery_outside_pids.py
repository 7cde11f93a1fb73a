"""Crash recovery tells a worker's own process from another that reuses its pid (R2).

A worker killed on this host is seen dead at once: no process has its pid. Once
another process takes that pid (a busy host recycles them), ``kill(pid, 0)`` says
"alive" and the dead worker's calls waited out its whole lease, ``requested``. A
process that started after the worker's last move is not the worker's: it is gone.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import stopline
from stopline import Cause, OpStatus
from tests.faults.recovery_outside_harness import outside_sql
from tests.truth.test_reconcile import left_behind

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def newer_process() -> Iterator[int]:
    """The pid of a live process started now (after the worker's calls last moved)."""
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()
        assert process.stdin is not None
        process.stdin.close()


async def test_a_pid_another_process_took_is_not_the_worker_alive(
    tmp_path: Path, newer_process: int
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    # its lease live, its pid a process's that started after its call last moved
    await left_behind(url, worker="w_reused", pid=newer_process)
    outside_sql(url, f"UPDATE operations SET updated_at = {time.time() - 3600}")
    async with stopline.open(url) as ledger:  # its recovery sees the worker gone
        op = await ledger.backend.get_operation("run_x/0:pay")
    assert op.status is OpStatus.UNKNOWN and op.cause is Cause.CRASH
    (crash,) = [e.detail for e in op.evidence if e.ref == "crash"]
    assert crash.endswith(f"its process (pid {newer_process}) died")


async def test_the_workers_own_live_process_keeps_its_calls(
    tmp_path: Path, newer_process: int
) -> None:
    """The same process, its lease live, its calls moving since it started: alive."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    await left_behind(url, worker="w_live", pid=newer_process)  # moved since it started
    async with stopline.open(url) as ledger:
        op = await ledger.backend.get_operation("run_x/0:pay")
    assert op.status is OpStatus.REQUESTED
