"""`stopline bench`: the gate's cost inside a Temporal activity and a DBOS step."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
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


async def test_the_bare_and_gated_rounds_alternate_after_an_uncounted_warm_up() -> None:
    """A change of the engine mid-measurement (Temporal's dev server slows its dispatch
    after its first second here) falls on both sides: the rounds take turns, each side
    going first in every other round, and the warm-up round of each is not counted."""
    calls: list[str] = []

    def side(name: str) -> Callable[[], Awaitable[float]]:
        async def once() -> float:
            calls.append(name)
            return float(len(calls))

        return once

    bare, gated = await engines._alternating(3, side("bare"), side("gated"))
    assert calls == ["bare", "gated", "bare", "gated", "gated", "bare", "bare", "gated"]
    assert bare == [3.0, 6.0, 7.0] and gated == [4.0, 5.0, 8.0]
