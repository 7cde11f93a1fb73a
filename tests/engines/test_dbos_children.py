"""``dbos.cancel`` finds a fenced child's DBOS workflow through DBOS's parent links alone,
on a real DBOS (SQLite and PostgreSQL).

A child whose run id is derived (its DBOS id, named after its parent's, has a tab or
is too long for a run id, ADR 0085) is not found under its run id: ``dbos.cancel``
walks DBOS's record of each workflow's children (``_engine_trees.workflows_of``, the
walk ``temporal.cancel`` shares). Tested alone: the workflows ran in another process,
now dead, and the cancelling process runs no gate and recovers none of them, so no
worker that remembers the child's id can do it instead.
"""

from __future__ import annotations

import gc
import uuid
from pathlib import Path

import anyio
import pytest
from dbos import DBOS

import stopline
from stopline import RunState
from stopline.integrations import dbos as stopline_dbos
from tests.engines.dbos_harness import MARKS, databases, launch, status, worker_process
from tests.engines.provider import FileProvider

pytestmark = MARKS

_ODD = {"tab": "tab\there-", "long": "w" * 1008}


async def _children(ledger: stopline.Ledger, run_id: str) -> dict[str, str]:
    """The child runs of ``run_id`` by name, once both are open (a barrier on the ledger)."""
    while True:
        kids = {r.name: r.id for r in await ledger.backend.list_runs() if r.parent_id == run_id}
        if len(kids) == 2:
            return kids
        await ledger.wait_for_change(run_id)


@pytest.mark.parametrize("shape", sorted(_ODD))
async def test_dbos_cancel_from_a_process_with_no_gate_cancels_a_derived_child(
    backend: str, tmp_path: Path, shape: str
) -> None:
    """A parent whose id has a tab (or is too long) starts two children in a worker
    process, which then dies; their runs are derived ids. From a process that launched
    DBOS but binds no gate, ``dbos.cancel`` of the parent fences its run and both
    children's (the shared one has no other owner, R6), and DBOS has cancelled the
    three workflows when it returns."""
    workflow_id = f"{_ODD[shape]}{uuid.uuid4().hex[:12]}"
    run_id = stopline_dbos.run_id_of(workflow_id)
    provider = FileProvider(tmp_path / "effects.jsonl")
    with databases(backend, tmp_path) as dbs:
        worker = await worker_process(dbs, provider, workflow_id, "parent")
        try:
            await worker.expect("started")
            async with stopline.open(dbs.ledger_url) as ledger:
                with anyio.fail_after(30):
                    kids = await _children(ledger, run_id)
        finally:
            await worker.kill()  # no worker from here: nobody else cancels in DBOS
        async with stopline.open(dbs.ledger_url) as ledger:
            launch(dbs, version="stopline-tests-canceller")  # recovers none of them
            try:
                receipt = await stopline_dbos.cancel(
                    ledger, workflow_id, by="user:42", reason="pressed stop"
                )
                by_run = {
                    stopline_dbos.run_id_of(c.workflow_id): c.workflow_id
                    for c in await DBOS.list_workflows_async(parent_workflow_id=workflow_id)
                }
                exclusive = by_run[kids["dbos:pipeline"]]
                shared = by_run[kids["dbos:shared_child"]]
                said = {w: await status(w) for w in (workflow_id, exclusive, shared)}
            finally:
                DBOS.destroy()
            runs = {r.id: r for r in await ledger.backend.list_runs()}
    gc.collect()  # what DBOS left goes now, inside the test (the harness's warning filter)
    assert receipt.run_id == run_id and "#sha256:" in run_id
    assert all("#sha256:" in kid for kid in kids.values())  # the children's runs: derived
    assert [runs[kid].state for kid in kids.values()] == [RunState.CANCELLED] * 2  # fenced
    # found through DBOS's parent links (old, had the walk been wrong: asked under the
    # derived run id, which DBOS does not know)
    assert said == {workflow_id: "CANCELLED", exclusive: "CANCELLED", shared: "CANCELLED"}
    assert provider.effects() == []
