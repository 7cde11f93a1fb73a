"""The ``stopline_explore`` fixture (entry point ``pytest11``): one test, a readable failure."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

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
