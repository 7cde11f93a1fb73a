"""A short soak: worker processes, a canceller, random faults; nothing violated or torn down."""

from __future__ import annotations

from pathlib import Path

import pytest

from stopline.bench.soak import soak


@pytest.mark.timeout(180)
def test_a_short_soak_violates_nothing_and_tears_nothing_down(tmp_path: Path) -> None:
    figures = soak(tmp_path, seconds=4, workers=2)
    assert figures["operations"] > 0
    assert sum(figures["faults"].values()) > 0
    assert figures["violations"] == 0, figures["first_violations"]
    assert figures["teardowns"] == 0
    assert figures["ledger_mib"] > 0  # the ledger's size at the end, its log included
