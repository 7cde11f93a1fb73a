"""Every cell id and re-run line works as printed; run ids and order come from the seed."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

import stopline
from stopline.testing import Barriers, FakeProvider
from stopline.testing.actions import CORE_ACTIONS, Cancel, CancelTwice
from stopline.testing.explorer import explore
from stopline.testing.mutations import gate_ignores_fence, receipt_overclaims

DOC = Path(__file__).parents[2] / "docs" / "testing.md"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def fan_out(run: stopline.Run, p: dict[str, FakeProvider]) -> None:
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL), anyio.create_task_group() as tg:
        tg.start_soon(run.call, p["mail"].tool, "a")
        tg.start_soon(run.call, p["chat"].tool, "b")


def two() -> dict[str, FakeProvider]:
    return {"mail": FakeProvider("mail"), "chat": FakeProvider("chat")}


async def test_the_same_seed_gives_the_same_matrix_whatever_the_scheduling() -> None:
    seen = []
    for _ in range(3):
        matrix = await explore(fan_out, two, actions=[Cancel()], seed=7, out=None)
        seen.append([(c.point, c.action, c.run_id, c.short()) for c in matrix])
    assert seen[0] == seen[1] == seen[2]


async def test_a_cells_run_id_is_its_own_whichever_cells_run_with_it() -> None:
    cell = "point=after_gate/mail action=cancel seed=7"
    alone = await explore(fan_out, two, actions=[Cancel()], only=cell, out=None)
    among = await explore(fan_out, two, actions=[CancelTwice(), Cancel()], only=cell, out=None)
    assert alone.cells[0].run_id == among.cells[0].run_id


async def test_the_discovery_runs_rerun_line_works_as_printed() -> None:
    async def send(run: stopline.Run, mail: FakeProvider) -> None:
        async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
            await run.call(mail.tool, "invoice #42")

    with receipt_overclaims():
        matrix = await explore(send, lambda: FakeProvider("mail"), actions=[Cancel()], out=None)
        hint = next(
            line for line in matrix.report().splitlines() if "(start)" in line and "only=" in line
        )
        only = hint.split('only="')[1].removesuffix('")')
        again = await explore(
            send, lambda: FakeProvider("mail"), actions=[Cancel()], only=only, out=None
        )
    assert again.cells == () and again.baseline is not None and not again.ok


async def test_a_point_named_with_spaces_reruns_alone(tmp_path: Path) -> None:
    class Editor:
        def __init__(self) -> None:
            self.mail = FakeProvider("mail")
            self.points = Barriers()

    async def edit(run: stopline.Run, env: Editor) -> None:
        await env.points.reach("editor go", run.id)
        async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
            await run.call(env.mail.tool, "x")

    matrix = await explore(edit, Editor, actions=[Cancel()], out=None)
    cell = matrix.cell("editor go", "cancel")
    alone = await explore(edit, Editor, actions=[Cancel()], only=cell.id, out=None)
    assert [(c.id, c.run_id) for c in alone] == [(cell.id, cell.run_id)]


async def test_the_discovery_runs_ledger_file_is_named_by_its_run_id(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'explore.db'}"
    matrix = await explore(
        fan_out,
        two,
        actions=[Cancel()],
        only="point=after_gate/mail action=cancel seed=0",
        ledger_url=url,
        out=None,
    )
    assert matrix.baseline is not None
    assert (tmp_path / f"explore-{matrix.baseline.run_id}.db").exists()
    assert (tmp_path / f"explore-{matrix.cells[0].run_id}.db").exists()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # once is enough
async def test_the_docs_reports_are_what_the_explorer_prints(anyio_backend: str) -> None:
    """docs/testing.md's matrix is its first example's; its FAIL block, the same
    example's under gate_ignores_fence()."""
    text = DOC.read_text()
    (block,) = re.findall(r"```\n(FAIL point=before_dispatch/mail.*?)```", text, flags=re.S)

    async def send_invoice(run: stopline.Run, mail: FakeProvider) -> None:
        async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
            await run.call(mail.tool, "invoice #42")

    with gate_ignores_fence():
        matrix = await explore(
            send_invoice, lambda: FakeProvider("mail"), actions=CORE_ACTIONS, out=None
        )

    # a log's numbers are the order things landed in: the broken gate's call races the
    # cancelled run's own settle step, landing before it or after
    def unnumbered(text: str) -> str:
        return re.sub(r"\(seq \d+\)", "(seq N)", text)

    assert unnumbered(block.strip()) in unnumbered(matrix.report())
    (table,) = re.findall(r"```\n(stopline explorer \(seed=0\).*?)```", text, flags=re.S)
    plain = await explore(
        send_invoice, lambda: FakeProvider("mail"), actions=CORE_ACTIONS, out=None
    )
    assert plain.report() == table.strip()
