"""What the fourth engines probe found on a real DBOS (P4), on SQLite and PostgreSQL,
ground truth in the provider's own log; barriers, no sleeps.

- A DBOS workflow id the ledger cannot keep as a run id (a control character, more
  than 1,024 characters) was refused at the workflow's start, and one of 1,015 to
  1,024 characters failed at its first step (its operation's id passed 1,024), while
  Temporal ran the same ids under a derived run id: one rule now (ADR 0085), the
  derived id (``dbos.run_id_of``), and a cancel of the workflow reaches it and the
  children it owns.
- ``DBOS.resume_workflow`` of a workflow whose run stopline cancelled, without
  ``ledger.resume`` first: the fence holds (R1, R10: a DBOS resume names no principal
  stopline could govern), the workflow is cancelled again in DBOS (so that it can be
  resumed once the run is), and the refusal says what to do, in DBOS's step record and
  the log (ADR 0085).
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from dbos import DBOS, SetWorkflowID

from stopline import Headline, OpStatus, RunState
from stopline.integrations import dbos as stopline_dbos
from tests.engines import dbos_app
from tests.engines.dbos_harness import (
    MARKS,
    Harness,
    cancelled_in_flight,
    harness,
    status,
    until_status,
)

pytestmark = MARKS

_ODD = {
    "tab": "tab\there-",  # a control character: no run id may hold it
    "long": "w" * 1008,  # 1,020 with its suffix: the run id fits, the step's id did not
}


async def _opened(h: Harness, run_id: str) -> None:
    """Until the workflow has opened its run (a barrier on the ledger)."""
    while run_id not in {r.id for r in await h.ledger.backend.list_runs()}:
        await h.ledger.wait_for_change(run_id)


@pytest.mark.parametrize("shape", sorted(_ODD))
async def test_p4_a_an_odd_workflow_id_runs_under_the_derived_run_id(
    backend: str, tmp_path: Path, shape: str
) -> None:
    """The workflow runs (old: refused at its start, or at its first step), each step
    once, and its receipt is the derived run's: stable, and no other id."""
    async with harness(backend, tmp_path) as h:
        workflow_id = f"{_ODD[shape]}{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["upload", "notify"])
        with anyio.fail_after(30):
            results: list[Any] = await handle.get_result()
        run_id = stopline_dbos.run_id_of(workflow_id)
        receipt = await h.ledger.wait_settled(run_id, timeout=15)
        runs = [r.id for r in await h.ledger.backend.list_runs()]
    assert run_id != workflow_id and "#sha256:" in run_id
    assert run_id == stopline_dbos.run_id_of(workflow_id)  # stable
    assert runs == [run_id]
    assert [r["id"] for r in results] == h.provider.effects()  # each step once
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.COMMITTED]


async def test_p4_b_a_cancel_reaches_an_odd_id_workflow_and_its_child(
    backend: str, tmp_path: Path
) -> None:
    """A parent whose id has a tab starts an exclusive child (DBOS names it after the
    parent: a tab too) and a shared one, which another workflow shares. ``dbos.cancel``
    by the workflow's DBOS id fences the derived run, and DBOS cancels the parent and
    the exclusive child; the shared child goes on. Nothing is sent by the cancelled
    ones."""
    async with harness(backend, tmp_path) as h:
        other = await DBOS.start_workflow_async(dbos_app.pipeline, [], True)
        await _opened(h, other.workflow_id)
        workflow_id = f"{_ODD['tab']}{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(dbos_app.parent, ["upload"])
        run_id = stopline_dbos.run_id_of(workflow_id)
        await _opened(h, run_id)
        children = [r for r in await h.ledger.backend.list_runs() if r.parent_id == run_id]
        while len(children) < 2:
            await h.ledger.wait_for_change(run_id)
            children = [r for r in await h.ledger.backend.list_runs() if r.parent_id == run_id]
        kids = await DBOS.list_workflows_async(parent_workflow_id=workflow_id)
        by_run = {stopline_dbos.run_id_of(k.workflow_id): k.workflow_id for k in kids}
        shared = next(by_run[r.id] for r in children if r.name.endswith("shared_child"))
        exclusive = next(by_run[r.id] for r in children if by_run[r.id] != shared)
        await h.ledger.share(
            stopline_dbos.run_id_of(shared), with_owner=other.workflow_id, by="user:42"
        )
        receipt = await stopline_dbos.cancel(h.ledger, workflow_id, by="user:42", reason="stop")
        await until_status(exclusive, "CANCELLED")
        await until_status(workflow_id, "CANCELLED")
        for waiting in (workflow_id, exclusive, shared):
            await DBOS.send_async(waiting, "go", "go")
        with anyio.fail_after(30):
            kept: list[Any] = await (await DBOS.retrieve_workflow_async(shared)).get_result()
        await DBOS.send_async(other.workflow_id, "go", "go")
        await other.get_result()
        with pytest.raises(BaseException, match="cancel"):
            await handle.get_result()
        runs = {r.id: r for r in await h.ledger.backend.list_runs()}
    assert receipt.run_id == run_id
    assert runs[stopline_dbos.run_id_of(exclusive)].cancelled_at is not None
    assert runs[stopline_dbos.run_id_of(shared)].state is RunState.COMPLETED
    assert h.provider.effects() == [kept[0]["id"]]  # the shared child's upload only


async def test_p4_c_dbos_resume_alone_is_refused_and_says_what_to_do(
    backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stopline cancel while ``upload`` is in flight; then ``DBOS.resume_workflow``
    without ``ledger.resume``: the run's fence holds (nothing more is sent), DBOS has the
    workflow cancelled again (so it stays resumable there), and the refusal names the
    fix (old: a bare "cancelled", nothing said). Following it, ``ledger.resume`` then
    ``DBOS.resume_workflow``, completes the workflow, each action once."""
    caplog.set_level(logging.WARNING, logger="stopline.integrations.dbos")
    async with harness(backend, tmp_path) as h:
        workflow_id = await cancelled_in_flight(h, ["upload", "notify"])
        before = h.provider.effects()
        caplog.clear()

        alone = await DBOS.resume_workflow_async(workflow_id)
        with anyio.fail_after(30), pytest.raises(Exception, match="cancelled"):
            await alone.get_result()
        dbos_says = await status(workflow_id)
        run = await h.ledger.backend.get_run(workflow_id)
        said = [r.getMessage() for r in caplog.records if r.name == "stopline.integrations.dbos"]
        after_alone = h.provider.effects()

        await h.ledger.resume(workflow_id, by="user:42")
        again = await DBOS.resume_workflow_async(workflow_id)
        with anyio.fail_after(30):
            await again.get_result()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
    assert after_alone == before  # the fence held: nothing sent
    assert dbos_says == "CANCELLED"
    assert run.state is RunState.CANCELLED and run.cancelled_by == "user:42"
    assert len(said) == 1
    assert f"ledger.resume({workflow_id!r}, by=...)" in said[0]  # old: nothing said
    assert f"then DBOS.resume_workflow({workflow_id!r})" in said[0]
    assert "user:42 (pressed stop)" in said[0]
    effects = h.provider.effects()
    assert len(effects) == 2 == len(set(effects))  # upload, notify: each once
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.COMMITTED]
