"""The ledger contract against a real SQLite file."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stopline.ledger.backend import Backend
from stopline.ledger.sqlite import SQLiteBackend
from tests.ledger.contract import LedgerContract
from tests.ledger.contract_lifecycle import LifecycleContract
from tests.ledger.contract_truth import TruthContract


class TestSQLiteLedger(LedgerContract, LifecycleContract, TruthContract):
    @pytest.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[Backend]:
        opened = await SQLiteBackend.open(tmp_path / "contract.db")
        try:
            yield opened
        finally:
            await opened.close()
