"""`stopline bench`: the gate's cost inside a Temporal activity and a DBOS step."""

from __future__ import annotations

from pathlib import Path

import pytest

from stopline.bench import engines


async def test_engine_figures_stand_beside_their_bare_baselines(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    figures = {f.name: f for f in await engines.measure(quick=True, workdir=tmp_path)}
    # The engines' own INFO logs (DBOS prints ~80 lines of migrations) stay out of the table.
    captured = capfd.readouterr()
    assert "DBOS launched" not in captured.out + captured.err
    assert set(figures) == {"temporal_activity_gated_ms", "dbos_step_gated_ms"}
    for figure in figures.values():
        assert figure.unit == "ms"
        assert figure.baseline is not None and figure.baseline > 0
        assert figure.ratio is not None and figure.value > 0
        print(figure.row(30))
