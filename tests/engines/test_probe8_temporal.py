"""An activity worker with the stopline plugin, serving a workflow whose worker has none
(ADR 0098), on a real Temporal dev server.

Temporal lets a task queue's workflows and activities be served by different workers.
With the plugin on the activity worker only, the workflow opened no run and its
activities carried no run header: the first gated activity created the workflow id's
run itself, which nothing ended (no ``end_run`` from a workflow side that is not
there): its receipt said "Running." for ever after the workflow completed, and a
workflow cancel fenced nothing. Its first attempt also failed on the heartbeat's read
of a run not yet made, and was retried. Now such an activity with effects is refused
before dispatch (``InvalidInput``, non-retryable, naming the workflow and the fix),
nothing sent and no run made, as a gated DBOS step of an ungated workflow is; a read
(no effects) runs as ever.

Ground truth is the provider's own file.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import Worker

from stopline.errors import UnknownRun
from stopline.integrations.temporal_server import TemporalDevServer
from tests.engines.temporal_harness import activities, harness, plugin
from tests.engines.temporal_workflows import Pipeline, Plan

pytestmark = pytest.mark.timeout(120)


async def test_an_activity_of_a_workflow_without_the_plugin_is_refused_before_dispatch(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    async with harness(temporal_server, tmp_path, worker=False) as h:
        acts = activities(h.provider)
        workflows = Worker(h.client, task_queue=h.task_queue, workflows=[Pipeline])
        gated = Worker(
            h.client,
            task_queue=h.task_queue,
            activities=acts,
            plugins=[plugin(h.ledger, h.provider, acts)],
        )
        async with workflows, gated:
            read = await h.start(Plan(["report"]), workflow_id=f"read-{uuid.uuid4().hex[:8]}")
            assert await read.result() == [f"report: report of {read.id}"]  # a read runs
            handle = await h.start(Plan(["upload"]), workflow_id=f"wf-{uuid.uuid4().hex[:8]}")
            with pytest.raises(WorkflowFailureError) as failed:
                await handle.result()
        cause = failed.value.cause
        assert isinstance(cause, ActivityError)
        refusal = cause.cause
        assert isinstance(refusal, ApplicationError)
        assert refusal.type == "InvalidInput" and refusal.non_retryable
        assert handle.id in refusal.message and "StoplinePlugin" in refusal.message
        assert not h.provider.path.exists() or h.provider.path.read_text() == ""  # nothing sent
        for workflow_id in (handle.id, read.id):  # no run nothing would end
            with pytest.raises(UnknownRun):
                await h.ledger.backend.get_run(workflow_id)
