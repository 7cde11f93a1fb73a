"""`stopline demo` (what `make demo` runs) tells the seeds' story in full."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

import stopline
from stopline.demo import EXPECTED, SEED_HEADLINES
from stopline.domain.receipt import HEADLINE_MESSAGES
from stopline.domain.vocab import OpStatus
from tests.surfaces.test_cli import stopline_cli

ROOT = Path(__file__).resolve().parents[2]
_HEADLINE = re.compile(
    "|".join(re.escape(m).replace(r"\{n\}", r"\d+") for m in HEADLINE_MESSAGES.values())
)


@pytest.mark.slow
def test_demo_prints_every_seed_headline_each_receipt_under_its_headline(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    done = stopline_cli("demo", ledger=url)
    assert done.returncode == 0, done.stdout + done.stderr
    for headline in SEED_HEADLINES:
        assert f"    {headline}\n" in done.stdout, headline
    lines = done.stdout.splitlines()
    told = [i for i, line in enumerate(lines) if line.endswith(("is told:", "evidence is in:"))]
    assert len(told) == 11  # six final receipts, five told at a moment before
    for i in told:
        assert _HEADLINE.fullmatch(lines[i + 1].strip()), lines[i + 1]
        rest = lines[i + 2 : next((j for j in told if j > i), len(lines))]
        for line in rest:  # every receipt line sits under its headline, none stray
            assert line.startswith(("    - ", "    (")) or not line.strip() or line[:3] == "== "

    async def check() -> None:
        async with stopline.open(url) as ledger:
            runs = await ledger.backend.list_runs(limit=10)
            receipts = [await ledger.receipt(run.id) for run in reversed(runs)]
            assert tuple(r.headline for r in receipts) == EXPECTED
            shared = await ledger.backend.operations(runs[1].id)
            originals = [op.status for op in shared if op.compensates is None]
            assert originals[0] is OpStatus.COMPENSATED  # the share, withdrawn
            (item,) = await ledger.review_items()
            assert item.run.id == runs[0].id and item.op.tool == "post_to_partner"

    anyio.run(check)


def test_make_demo_runs_the_demo_command() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "$(BIN)/stopline demo" in recipe
