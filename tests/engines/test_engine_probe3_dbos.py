"""What the third engines probe found on a real DBOS (P3), on SQLite and PostgreSQL,
ground truth in the provider's own log; barriers, no sleeps.

- ``DBOS.fork_workflow`` of a workflow cancelled while a step DBOS does not preempt
  was at work: the step committed, DBOS refused to record its result (the cancel
  took the workflow), and the fork ran it again under the fork's id: a second
  effect, though the original's receipt said it completed (ADR 0072).
- A DBOS workflow timeout was recorded as ``DBOS.cancel_workflow``: the receipt named
  a cancel nobody made.
- A DBOS workflow whose id was the id of another's live run (an agent's
  ``ledger.run(run_id=...)``) joined it: its steps went into the agent's run, and
  its end ended the agent's run while the agent was still at work in it.
- ``DBOS.rewind_workflow`` of a workflow that failed: the gate refused the next step
  of the finished run, and stopline then cancelled the workflow in DBOS, whose status
  said CANCELLED though nobody cancelled.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from dbos import DBOS, SetWorkflowID, SetWorkflowTimeout

from stopline import Headline, OpStatus, RunState
from stopline.ledger.backend import RunSpec
from tests.engines import dbos_app, subprocess_worker
from tests.engines.dbos_harness import MARKS, databases, harness, running, status
from tests.engines.provider import FileProvider

pytestmark = MARKS


async def test_p3_a_fork_does_not_resend_a_step_dbos_never_recorded(
    backend: str, tmp_path: Path
) -> None:
    """``notify`` (not preemptible) commits after ``DBOS.cancel_workflow``: DBOS keeps
    no result for it, stopline's receipt says it completed. A fork from step 2 (step 1
    to be kept) gets the original's recorded result for it and sends ``upload`` only;
    a fork from a step DBOS did record still runs it again, as asked."""
    async with harness(backend, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["notify", "upload"])
        await hold.reached.wait()
        await DBOS.cancel_workflow_async(workflow_id)
        hold.release()
        with pytest.raises(BaseException, match="cancelled"):  # DBOS: awaited, cancelled
            await handle.get_result()
        stopped = await h.ledger.wait_settled(workflow_id, timeout=15)
        assert [line.status for line in stopped.lines] == [OpStatus.COMMITTED]
        assert await DBOS.list_workflow_steps_async(workflow_id) == []  # DBOS: nothing ran
        notified = h.provider.effects()
        assert len(notified) == 1

        fork = await DBOS.fork_workflow_async(workflow_id, 2)
        with anyio.fail_after(30):
            results: list[Any] = await fork.get_result()
        forked = await h.ledger.wait_settled(fork.workflow_id, timeout=15)
        after_fork = h.provider.effects()

        again = await DBOS.fork_workflow_async(fork.workflow_id, 2)  # upload: recorded
        with anyio.fail_after(30):
            await again.get_result()
    assert after_fork[:1] == notified  # old: the fork's notify was a second effect
    assert len(after_fork) == 2 and fork.workflow_id in after_fork[1]  # its upload only
    assert results[0]["id"] == notified[0]  # the original's result, from the ledger
    assert forked.headline is Headline.COMPLETED
    assert [line.status for line in forked.lines] == [OpStatus.COMMITTED]
    assert len(h.provider.effects()) == 3  # a fork at a recorded step runs it, as asked
    assert again.workflow_id in h.provider.effects()[2]


async def test_p3_b_a_dbos_timeout_is_recorded_as_a_timeout(backend: str, tmp_path: Path) -> None:
    """The workflow's deadline passes while ``upload`` (preemptible) waits: DBOS cancels
    it; the run's cancel says DBOS's timeout did, not ``DBOS.cancel_workflow``."""
    async with harness(backend, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id), SetWorkflowTimeout(0.5):
            handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["upload"])
        await hold.reached.wait()  # held until DBOS's watcher cut it
        while (await h.ledger.backend.get_run(workflow_id)).cancelled_at is None:
            await h.ledger.wait_for_change(workflow_id)  # the fence: after the cut
        hold.release()
        with pytest.raises(BaseException, match="cancelled"):
            await handle.get_result()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        run = await h.ledger.backend.get_run(workflow_id)
    assert run.cancel_reason == "DBOS workflow timeout"  # old: "DBOS.cancel_workflow"
    assert receipt.cancelled_by == "dbos"
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert h.provider.effects() == []


async def test_p3_c_a_rewound_finished_workflow_is_not_cancelled_in_dbos(
    backend: str, tmp_path: Path
) -> None:
    """A workflow fails after ``notify`` (a bug: no such step); the bug fixed,
    ``DBOS.rewind_workflow`` runs it again from step 2. Its run is finished (failed):
    the gate refuses ``upload``, and the workflow fails in DBOS with ``RunEnded``,
    which says to fork it; nobody cancelled it, and DBOS does not say so. (``upload``
    has no DBOS retries: a step that has them retries ``RunEnded`` as DBOS retries any
    error, unless its ``should_retry`` says not to.)"""
    async with harness(backend, tmp_path) as h:
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(
                dbos_app.pipeline, ["notify", "p3-missing", "upload"]
            )
        with pytest.raises(KeyError):
            await handle.get_result()
        failed = await h.ledger.wait_settled(workflow_id, timeout=15)
        assert failed.headline is Headline.FAILED
        dbos_app.STEPS["p3-missing"] = dbos_app.report  # the bug fixed
        try:
            rewound = await DBOS.rewind_workflow_async(workflow_id, start_step=2)
            with anyio.fail_after(30), pytest.raises(Exception, match="fork_workflow"):
                await rewound.get_result()  # old: DBOSAwaitedWorkflowCancelledError
        finally:
            del dbos_app.STEPS["p3-missing"]
        dbos_says = await status(workflow_id)
        run = await h.ledger.backend.get_run(workflow_id)
    assert dbos_says == "ERROR"  # old: CANCELLED
    assert run.cancelled_at is None and run.state is RunState.FAILED
    assert len(h.provider.effects()) == 1  # notify, once; upload never sent


async def test_p3_d_a_workflow_does_not_join_another_s_run_of_its_id(
    backend: str, tmp_path: Path
) -> None:
    """An agent's run ``order-...`` is live; a DBOS workflow is started with the same id.
    It is refused (``NotPermitted``, naming the run) before any step: nothing is sent,
    and the agent's run is still the agent's, running, with no operation of DBOS's."""
    async with harness(backend, tmp_path) as h:
        run_id = f"order-{uuid.uuid4().hex[:8]}"
        async with h.ledger.run("agent task", run_id=run_id, owner="user:7"):
            with SetWorkflowID(run_id):
                handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["upload"])
            with anyio.fail_after(30), pytest.raises(Exception, match="does not join"):
                await handle.get_result()  # old: it ran, in the agent's run
            during = await h.ledger.backend.get_run(run_id)
            ops = await h.ledger.backend.operations(run_id)
        dbos_says = await status(run_id)
    assert during.state is RunState.RUNNING  # old: completed, by the workflow's end
    assert ops == []
    assert h.provider.effects() == []
    assert dbos_says == "ERROR"


async def test_p3_d2_a_workflow_does_not_join_another_tenant_s_run_of_its_id(
    backend: str, tmp_path: Path
) -> None:
    """Two apps of two tenants on one ledger: a DBOS workflow's run of tenant ``acme``
    exists; this app (tenant ``default``) starts a workflow with the same id. It is
    refused before any step, naming both tenants: it would have joined acme's run."""
    async with harness(backend, tmp_path) as h:
        run_id = f"wf-{uuid.uuid4().hex[:8]}"
        spec = RunSpec(id=run_id, name="dbos:pipeline", owner="dbos:acme", tenant="acme")
        await h.ledger.backend.create_run(spec)
        with SetWorkflowID(run_id):
            handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["upload"])
        with anyio.fail_after(30), pytest.raises(Exception, match="tenant 'acme'"):
            await handle.get_result()  # old: it ran, in acme's run
        ops = await h.ledger.backend.operations(run_id)
    assert ops == []
    assert h.provider.effects() == []


async def test_p3_e_sigkilled_before_the_effect_recovery_sends_it_once(
    backend: str, tmp_path: Path
) -> None:
    """The worker passed the gate for ``upload`` and dies (SIGKILL) before the provider
    committed anything. DBOS recovers the workflow in a new process: the operation in
    flight is read back (nothing there) and sent once; the receipt says completed."""
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
            "received",
        )
        try:
            reached = await child.expect("reached received ")
        finally:
            await child.kill()
        assert provider.effects() == []
        async with running(dbs, provider) as h:  # DBOS.launch() recovers the workflow
            with anyio.fail_after(60):
                results: list[Any] = await (
                    await DBOS.retrieve_workflow_async(workflow_id)
                ).get_result()
            receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
            events = await h.ledger.backend.events(workflow_id)
    key = reached.split(" ", 2)[2]
    assert provider.effects() == [key, results[1]["id"]]  # upload once, then notify
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.COMMITTED]
    upload = [e.kind for e in events if e.op_id == key]
    assert upload.count("gate_passed") == 2  # the dead worker's, then the recovery's
