"""The ``stopline_explore`` fixture (entry point ``pytest11``): one test, a readable failure."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from stopline.testing.explorer import Matrix
from stopline.testing.mutations import gate_ignores_fence
from tests.testing.workflows import Demo, report_upload_notify

Explore = Callable[..., Awaitable[Matrix]]
CELL = "point=before_dispatch/notify action=cancel seed=0"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_the_fixture_passes_a_truthful_workflow(stopline_explore: Explore) -> None:
    matrix = await stopline_explore(report_upload_notify, Demo, only=CELL)
    assert matrix.ok and len(matrix) == 1


async def test_the_fixture_fails_with_the_report(stopline_explore: Explore) -> None:
    with gate_ignores_fence(), pytest.raises(pytest.fail.Exception) as failed:
        await stopline_explore(report_upload_notify, Demo, only=CELL)
    message = str(failed.value)
    assert "R1" in message
    assert f're-run alone: explore(..., only="{CELL}")' in message
    assert "passed the gate" in message


def test_the_plugin_is_registered(pytestconfig: Any) -> None:
    assert pytestconfig.pluginmanager.has_plugin("stopline")


async def test_two_explorations_at_once_in_one_test_keep_files_apart(
    stopline_explore: Explore, tmp_path: Path
) -> None:
    matrices: list[Matrix] = []

    async def one() -> None:
        matrices.append(await stopline_explore(report_upload_notify, Demo, only=CELL))

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        tg.start_soon(one)
    assert all(m.ok for m in matrices)
    names = {p.name async for p in anyio.Path(tmp_path).glob("*.db")}
    assert any(n.startswith("explore-1-") for n in names)
    assert any(n.startswith("explore-2-") for n in names)


def test_a_sync_test_asking_for_the_fixture_fails_at_once(tmp_path: Path) -> None:
    """A test that is not async calls the fixture and awaits nothing: nothing was
    explored and the test passed (a RuntimeWarning aside). It fails at once, saying why."""
    (tmp_path / "test_forgot.py").write_text(
        "def test_forgot(stopline_explore):\n    stopline_explore(None, None)\n"
    )
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_forgot.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert ran.returncode != 0, ran.stdout
    assert "stopline_explore is awaited, so the test must be async" in ran.stdout
