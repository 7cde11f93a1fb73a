"""The tree cancel's figure: measured beside bare task cancels, with its stretches."""

from __future__ import annotations

import re
from pathlib import Path

from stopline.bench.lifecycle import measure


async def test_the_tree_cancel_says_when_its_fence_was_delivered(tmp_path: Path) -> None:
    """The note gives the moment the fence was durable and delivered, which comes
    before the last interruption the figure measures (timings are not asserted)."""
    (figure,) = await measure(quick=True, workdir=tmp_path)
    assert figure.name == "cancel_tree_10k_ms" and figure.baseline
    delivered = re.search(r"delivered at ([\d.]+) ms$", figure.note)
    assert delivered is not None
    assert 0 < float(delivered[1]) <= figure.value
