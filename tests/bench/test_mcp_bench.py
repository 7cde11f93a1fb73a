"""`stopline bench`'s MCP figures: a real stdio server, the gated and the bare call.

Timings are never asserted: this checks that both figures are measured in the
same run, each with its same-run baseline, in the bench's JSON shape.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stopline.bench.mcp import measure


@pytest.mark.timeout(120)
async def test_the_mcp_overhead_is_measured_against_a_bare_durable_txn(tmp_path: Path) -> None:
    ratio, added, verify = await measure(quick=True, workdir=tmp_path)
    assert (ratio.name, added.name) == ("mcp_call_overhead_ratio", "mcp_call_overhead_us")
    assert verify.name == "mcp_verify_us"  # a read-back's round trip, against the bare call
    for figure in (ratio, added, verify):
        shape = figure.to_json()
        assert set(shape) >= {"value", "unit", "baseline", "ratio"}
        assert figure.baseline is not None and figure.baseline > 0
    assert ratio.value > 0  # the gated call's p50, against the bare call's
    assert added.target == "ratio <= 1.3"  # issue 18: gated - bare <= 1.3x one bare txn
    assert (tmp_path / "mcp-bare.db").exists()  # the baseline's own transactions ran
