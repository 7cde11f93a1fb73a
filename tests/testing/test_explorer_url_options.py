"""The explorer's ``ledger_url`` options reach each cell's ledger.

``ledger_url="sqlite:///DIR/NAME.db?synchronous=OFF"`` kept each cell's ledger as
``DIR/NAME-<run id>.db`` and dropped everything after ``?`` without a word: a user who
set an option (a faster ``synchronous`` for a large matrix, a longer ``busy_timeout``)
ran without it, and a misspelt one was never refused. Each cell's ledger is now opened
with the URL's options, so an option the ledger refuses stops the exploration at its
discovery run (``ExplorerError`` naming the ledger's ``LedgerUnavailable``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import stopline
from stopline.testing import FakeProvider
from stopline.testing.actions import Cancel
from stopline.testing.explorer import ExplorerError, explore

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _mail() -> dict[str, FakeProvider]:
    return {"mail": FakeProvider("mail")}


async def _send(run: stopline.Run, p: dict[str, FakeProvider]) -> None:
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        await run.call(p["mail"].tool, "invoice #42")


async def test_an_option_the_ledger_does_not_know_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'explore.db'}?synchronus=OFF"  # misspelt
    with pytest.raises(ExplorerError, match=r"LedgerUnavailable.*synchronus"):
        await explore(_send, _mail, actions=[Cancel()], ledger_url=url, out=None)


async def test_the_options_reach_each_cells_ledger_and_its_file_is_named_as_before(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'explore.db'}?synchronous=NORMAL&busy_timeout=20"
    matrix = await explore(_send, _mail, actions=[Cancel()], ledger_url=url, out=None)
    assert matrix.ok, matrix.report()
    files = _names(tmp_path)
    ledgers = [name for name in files if name.startswith("explore-") and name.endswith(".db")]
    assert "explore-x0-discover.db" in ledgers
    assert len(ledgers) == len(matrix.points) + 1  # one per cell, and the discovery run's
    assert not [name for name in files if "?" in name]


def _names(where: Path) -> list[str]:
    return sorted(p.name for p in where.iterdir())
