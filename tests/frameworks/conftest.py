"""Fixtures of the framework tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import stopline
from tests.conftest import FAST_VERIFY


@pytest.fixture
async def unwatched(ledger_url: str) -> AsyncIterator[stopline.Ledger]:
    """A worker's ledger that does not watch for cancels committed by other processes
    (``cancel_poll_ms=0``, as behind a pooler with no notifications): such a cancel
    reaches its runs at their next gate, which is what the "cancel before the call"
    scenarios prove. With the watch, the same cancel would interrupt the model's
    thinking first, and which comes first would be a race."""
    assert ledger_url.startswith("sqlite:///")
    async with stopline.open(f"{ledger_url}?cancel_poll_ms=0", verify=FAST_VERIFY) as opened:
        yield opened
