"""The ledger contract against PostgreSQL, each test in a schema of its own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from stopline.ledger.backend import Backend
from tests.ledger.contract import LedgerContract
from tests.ledger.contract_lifecycle import LifecycleContract
from tests.ledger.contract_truth import TruthContract
from tests.postgres.server import fresh_schema


@pytest.fixture
def pg_url() -> Iterator[str]:
    yield from fresh_schema()


class TestPostgresLedger(LedgerContract, LifecycleContract, TruthContract):
    @pytest.fixture
    async def backend(self, pg_url: str) -> AsyncIterator[Backend]:
        from stopline.ledger.postgres import PostgresBackend

        opened = await PostgresBackend.open(pg_url)
        try:
            yield opened
        finally:
            await opened.close()
