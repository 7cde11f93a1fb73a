"""Shared fixtures: a real SQLite ledger file per test, on asyncio."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import stopline
from stopline import VerifyBudget

FAST_VERIFY = VerifyBudget(attempts=4, first_delay=0.01, factor=2.0, max_delay=0.05)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and inspect.iscoroutinefunction(function):
            item.add_marker(pytest.mark.anyio)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
async def ledger(ledger_url: str) -> AsyncIterator[stopline.Ledger]:
    async with stopline.open(ledger_url, verify=FAST_VERIFY) as opened:
        yield opened
