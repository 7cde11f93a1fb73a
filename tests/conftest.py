"""Shared fixtures: a real SQLite ledger file per test, on asyncio."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import stopline
from stopline import VerifyBudget

FAST_VERIFY = VerifyBudget(attempts=4, first_delay=0.01, factor=2.0, max_delay=0.05)


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio; modules that prove trio too override this."""
    return "asyncio"


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
async def ledger(ledger_url: str) -> AsyncIterator[stopline.Ledger]:
    async with stopline.open(ledger_url, verify=FAST_VERIFY) as opened:
        yield opened
