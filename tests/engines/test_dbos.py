"""DBOS: the contract on SQLite and on the machine's PostgreSQL, ground truth in a file.

Each test runs a real DBOS application (``dbos_app``) whose system tables
live beside the ledger (on PostgreSQL in the same database); the provider
logs its own commits to a file, which is what the assertions trust.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from dbos import DBOS

import stopline
from stopline import Headline, OpStatus
from stopline.cli import main as cli
from tests.conftest import FAST_VERIFY
from tests.engines import dbos_app, subprocess_worker
from tests.engines.dbos_harness import MARKS, Harness, databases, harness, running
from tests.engines.dbos_harness import status as _status
from tests.engines.provider import FileProvider

# both engines; a psycopg connection of a short-lived ledger collected unclosed, seen
# twice in ~30 runs on PostgreSQL and never alone, tolerated by name (the harness's)
pytestmark = MARKS


async def _opened(h: Harness, *run_ids: str) -> None:
    """Until each workflow has opened its run (a barrier on the ledger)."""
    for run_id in run_ids:
        while run_id not in {r.id for r in await h.ledger.backend.list_runs()}:
            await h.ledger.wait_for_change(run_id)


async def test_dbos_steps_pass_the_gate_once(backend: str, tmp_path: Path) -> None:
    async with harness(backend, tmp_path) as h:
        handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["report", "upload", "notify"])
        results = await handle.get_result()
        receipt = await h.ledger.wait_settled(handle.workflow_id, timeout=10)
    assert results[0].startswith("report: ")  # a read: no gate record
    assert [r["id"] for r in results[1:]] == h.provider.effects()
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.COMMITTED]


async def test_s1_dbos_cancel_before_dispatch_from_the_cli(backend: str, tmp_path: Path) -> None:
    """The CLI fences the run from another process. The worker's ledger hears of it
    (PostgreSQL's notification, SQLite's watch on the file) and cancels the workflow
    in DBOS; when the workflow goes on, DBOS's own check refuses the step. Nothing
    reaches the provider, and no call was made."""
    async with harness(backend, tmp_path) as h:
        handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["upload"], True)
        await _opened(h, handle.workflow_id)
        argv = ["--ledger", h.dbs.ledger_url, "cancel", handle.workflow_id, "--wait"]
        assert await anyio.to_thread.run_sync(cli, argv) == 0
        with anyio.fail_after(30):  # the worker heard: DBOS has the workflow cancelled
            # DBOS offers nothing to await for a status: look until it changes
            while await _status(handle.workflow_id) != "CANCELLED":  # noqa: ASYNC110
                await anyio.sleep(0.05)
        await DBOS.send_async(handle.workflow_id, "go", "go")
        with pytest.raises(BaseException, match="cancel"):
            await handle.get_result()
        receipt = await h.ledger.wait_settled(handle.workflow_id, timeout=10)
    assert h.provider.effects() == []
    assert h.provider.barriers.passed == []
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert receipt.lines == ()  # the step never reached the gate


async def test_s3_dbos_cancel_after_commit_before_response_is_verified_committed(
    backend: str, tmp_path: Path
) -> None:
    """``DBOS.cancel_workflow`` preempts the (preemptible) step after the provider
    committed: the call is ``unknown`` (never "not sent"), the run is fenced, and the
    read-back finds the commit."""
    async with harness(backend, tmp_path) as h:
        hold = h.provider.barriers.hold("committed")
        handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["upload", "notify"])
        await hold.reached.wait()
        await DBOS.cancel_workflow_async(handle.workflow_id)
        with pytest.raises(BaseException, match="cancel"):
            await handle.get_result()
        receipt = await h.ledger.wait_settled(handle.workflow_id, timeout=15)
        events = await h.ledger.backend.events(handle.workflow_id)
    assert h.provider.effects() == [hold.key]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert ("lost", "unknown") in [(e.kind, e.to_state) for e in events]  # R3
    assert receipt.lines[0].evidence[-1].kind.value == "read_back"
    assert receipt.cancelled_by == "dbos"
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_s9_dbos_late_success_after_a_stopline_cancel_is_kept(
    backend: str, tmp_path: Path
) -> None:
    """A stopline cancel fences the run and cancels the DBOS workflow; the running
    (not preemptible) step commits afterwards: kept as late evidence, and DBOS runs
    no further step of the workflow."""
    async with harness(backend, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["notify", "upload"])
        await hold.reached.wait()
        await h.ledger.cancel(handle.workflow_id, by="user:42", reason="pressed stop")
        while await _status(handle.workflow_id) != "CANCELLED":
            await h.ledger.wait_for_change(handle.workflow_id)
        hold.release()
        with pytest.raises(BaseException, match="cancel"):
            await handle.get_result()
        receipt = await h.ledger.wait_settled(handle.workflow_id, timeout=10)
        late = [e for e in await h.ledger.backend.events(handle.workflow_id) if "late" in e.data]
    assert h.provider.effects() == [hold.key]  # upload never ran
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert late and late[0].data["late"] is True
    assert receipt.cancelled_by == "user:42"
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_s11_dbos_step_retry_after_the_fence_is_refused_at_the_gate(
    backend: str, tmp_path: Path
) -> None:
    """DBOS retries a refused step; the fence landed (from another process) before the
    retry, which is refused at the gate and never reaches the provider."""
    async with harness(backend, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["notify"])
        await hold.reached.wait()
        async with stopline.open(h.dbs.ledger_url, verify=FAST_VERIFY) as elsewhere:
            await elsewhere.cancel(handle.workflow_id, by="user:42", reason="pressed stop")
        h.provider.reject_next = True
        hold.release()
        with pytest.raises(BaseException, match="cancel"):
            await handle.get_result()
        receipt = await h.ledger.wait_settled(handle.workflow_id, timeout=10)
        events = await h.ledger.backend.events(handle.workflow_id)
    assert h.provider.effects() == []
    assert [p for p, _ in h.provider.barriers.passed] == ["received"]  # one attempt only
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED]
    assert [e.kind for e in events if e.op_id][-1] == "gate_refused"


async def test_s13_dbos_exclusive_child_is_cancelled_shared_child_goes_on(
    backend: str, tmp_path: Path
) -> None:
    async with harness(backend, tmp_path) as h:
        other = await DBOS.start_workflow_async(dbos_app.pipeline, [], True)
        handle = await DBOS.start_workflow_async(dbos_app.parent, ["upload"])
        await _opened(h, other.workflow_id, handle.workflow_id)
        children = [
            r for r in await h.ledger.backend.list_runs() if r.parent_id == handle.workflow_id
        ]
        while len(children) < 2:
            await h.ledger.wait_for_change(handle.workflow_id)
            children = [
                r for r in await h.ledger.backend.list_runs() if r.parent_id == handle.workflow_id
            ]
        shared = next(r.id for r in children if r.name.endswith("shared_child"))
        exclusive = next(r.id for r in children if r.id != shared)
        await h.ledger.share(shared, with_owner=other.workflow_id, by="user:42")
        await h.ledger.cancel(handle.workflow_id, by="user:42", reason="pressed stop")
        while await _status(exclusive) != "CANCELLED":
            await h.ledger.wait_for_change(exclusive)
        await DBOS.send_async(shared, "go", "go")
        shared_result: list[Any] = await (await DBOS.retrieve_workflow_async(shared)).get_result()
        await DBOS.send_async(other.workflow_id, "go", "go")
        await other.get_result()
        runs = {r.id: r for r in await h.ledger.backend.list_runs()}
    assert runs[exclusive].state is not stopline.RunState.RUNNING
    assert runs[shared].state is stopline.RunState.COMPLETED
    assert h.provider.effects() == [shared_result[0]["id"]]


async def test_s17_dbos_process_sigkilled_mid_step_no_duplicate_effect(
    backend: str, tmp_path: Path
) -> None:
    """The step commits, then its process dies before DBOS's checkpoint; DBOS recovers
    the workflow in a new process and runs the step again: stopline reads the effect
    back instead of sending it again."""
    workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
    provider = FileProvider(tmp_path / "effects.jsonl")
    with databases(backend, tmp_path) as dbs:
        child = await subprocess_worker.start(
            "tests.engines.dbos_worker",
            dbs.system_url,
            dbs.schema,
            dbs.ledger_url,
            str(provider.path),
            workflow_id,
        )
        try:
            committed = await child.expect("committed ")
        finally:
            await child.kill()
        async with running(dbs, provider) as h:  # DBOS.launch() recovers the workflow
            results: list[Any] = await (
                await DBOS.retrieve_workflow_async(workflow_id)
            ).get_result()
            receipt = await h.ledger.wait_settled(workflow_id, timeout=10)
    key = committed.split(" ", 1)[1]
    assert provider.effects() == [key, results[1]["id"]]  # upload once, then notify
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.COMMITTED]
    assert "read_back" in [e.kind.value for e in receipt.lines[0].evidence]
