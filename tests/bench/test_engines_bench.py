"""`stopline bench`: the gate's cost inside a Temporal activity and a DBOS step."""

from __future__ import annotations

import logging
from pathlib import Path

from stopline.bench import engines


async def test_engine_figures_stand_beside_their_bare_baselines(tmp_path: Path) -> None:
    dbos_log = logging.getLogger("dbos")
    before = dbos_log.level
    dbos_log.setLevel(logging.INFO)  # as a process that has not configured DBOS yet
    try:
        figures = {f.name: f for f in await engines.measure(quick=True, workdir=tmp_path)}
        # DBOS's own INFO log (~80 lines of its migrations) stays out of the bench's table:
        # the gated step configures DBOS at ERROR, as the peer's figure does
        assert dbos_log.level == logging.ERROR
    finally:
        dbos_log.setLevel(before)
    assert set(figures) == {"temporal_activity_gated_ms", "dbos_step_gated_ms"}
    for figure in figures.values():
        assert figure.unit == "ms"
        assert figure.baseline is not None and figure.baseline > 0
        assert figure.ratio is not None and figure.value > 0
        print(figure.row(30))
