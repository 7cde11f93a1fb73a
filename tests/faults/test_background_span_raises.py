"""A span processor that raises at the ``stopline.background`` span (the SDK runs it
inline, in the error boundary's own handler) cancels no run (ADR 0011, ADR 0077).
Before, it escaped the boundary into the ledger's task group, which cancelled every
run of the process. Run in a process of its own: the global tracer provider, which
the boundary's span uses, can be set once per process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def test_a_raising_processor_at_a_background_failure_cancels_no_run(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.faults.background_span_agent", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["raised"] >= 1 and said["failures"] >= 1  # the processor did raise there
    assert said["b"] == "completed" and said["b_lines"] == ["committed", "committed"]
    assert said["a"] == "cancelled" and said["a_lines"] == ["committed"]
