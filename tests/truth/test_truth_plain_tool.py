"""Issue 20 for a plain async tool with a ``canceller``: the truth matrix, printed.

The tool's provider is in this process but works like a remote one
(tests/support/truth_tools.py). CI runs every tool mode x every cancel point
under the default policy with a read-back, and every policy and the
no-verifier column at 50 %; ``STOPLINE_TRUTH_MATRIX=full`` runs the whole
cross-product (4 modes x 6 points x 3 policies x 2 verifiers):

    STOPLINE_TRUTH_MATRIX=full pytest tests/truth/test_truth_plain_tool.py -s
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

import stopline
from tests.conftest import FAST_VERIFY
from tests.support.truth_matrix import Cell, Row, baseline_cells, render, totals
from tests.support.truth_tools import Provider, Tools, plain_cells, run_bare, run_cell

FULL = os.environ.get("STOPLINE_TRUTH_MATRIX") == "full"
pytestmark = pytest.mark.timeout(600 if FULL else 120)


async def test_issue20_plain_tool_with_a_canceller_truth_matrix(tmp_path: Path) -> None:
    cells = plain_cells(FULL)
    bare = baseline_cells(cells)
    rows: list[Row] = []
    bare_rows: list[Row] = []
    async with anyio.create_task_group() as provider_tg:
        provider = Provider(provider_tg)
        tools = Tools(provider)
        async with stopline.open(
            f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY
        ) as ledger:
            limiter = anyio.CapacityLimiter(12)

            async def one(cell: Cell, n: int) -> None:
                async with limiter:
                    rows.append(await run_cell(ledger, tools, cell, n))

            async def one_bare(cell: Cell, n: int) -> None:
                async with limiter:
                    bare_rows.append(await run_bare(provider, cell, n))

            async with anyio.create_task_group() as tg:
                for n, cell in enumerate(cells):
                    tg.start_soon(one, cell, n)
                for n, cell in enumerate(bare):
                    tg.start_soon(one_bare, cell, n)
    rows.sort(key=lambda r: r.cell.name)
    bare_rows.sort(key=lambda r: r.cell.name)
    default = [r for r in rows if r.cell.policy is stopline.Policy.VERIFY]
    summary = {
        "bare: asyncio task cancel": bare_rows,
        "stopline, default verify policy": default,
        "stopline, immediate policy": [
            r for r in rows if r.cell.policy is stopline.Policy.IMMEDIATE
        ],
        "stopline, every policy": rows,
    }
    print("\n" + render([*rows, *bare_rows], summary))
    _, false_claims, duplicates = totals(rows)
    assert false_claims == 0, [r.cell.name for r in rows if r.verdict == "FALSE"]
    assert duplicates == 0, [r.cell.name for r in rows if r.duplicates]
    definite = [r for r in rows if r.cell.verifier == "read_tool"]
    assert [r.cell.name for r in definite if r.verdict != "ok"] == []
    covered = {(r.cell.mode, r.cell.point) for r in default}
    bare_same = [r for r in bare_rows if (r.cell.mode, r.cell.point) in covered]
    assert totals(default)[0] >= totals(bare_same)[0]
    # the canceller is what makes the difference: a provider that stops only when asked
    asked = [r for r in default if r.cell.mode == "pay_ask_only" and r.cell.point != "never"]
    assert all(r.prevented for r in asked), [r.cell.name for r in asked if not r.prevented]
