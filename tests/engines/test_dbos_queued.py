"""DBOS: a stopline cancel of a workflow DBOS has enqueued and not started yet (behind a
concurrency-1 queue). It raised ``UnknownRun`` and DBOS's cancel was never sent: the
workflow ran later and its effect happened."""

from __future__ import annotations

import uuid
from pathlib import Path

import anyio
import pytest
from dbos import DBOS, SetWorkflowID

from stopline import Headline
from stopline.integrations import dbos as stopline_dbos
from tests.engines import dbos_app
from tests.engines.dbos_harness import harness

pytestmark = [
    pytest.mark.parametrize("backend", ["sqlite", "postgres"]),
    pytest.mark.filterwarnings(  # as in test_dbos.py: a psycopg connection of the pool's
        "ignore:Exception ignored in. <function BaseConnection.__del__"
        ":pytest.PytestUnraisableExceptionWarning"
    ),
]


async def _status(workflow_id: str) -> str:
    status = await DBOS.get_workflow_status_async(workflow_id)
    assert status is not None
    return str(status.status)


async def test_dbos_cancel_of_an_enqueued_workflow_fences_it_and_cancels_it(
    backend: str, tmp_path: Path
) -> None:
    async with harness(backend, tmp_path) as h:
        tag = uuid.uuid4().hex[:8]
        # one workflow at a time: the second waits ENQUEUED while the first holds the slot
        queue = await DBOS.register_queue_async(
            f"one-at-a-time-{tag}", concurrency=1, polling_interval_sec=0.05
        )
        with SetWorkflowID(f"first-{tag}"):
            first = await queue.enqueue_async(dbos_app.pipeline, ["upload"], True)
        with SetWorkflowID(f"second-{tag}"):
            second = await queue.enqueue_async(dbos_app.pipeline, ["upload"])
        while first.workflow_id not in {r.id for r in await h.ledger.backend.list_runs()}:
            await h.ledger.wait_for_change(first.workflow_id)  # the first holds the slot
        assert await _status(second.workflow_id) == "ENQUEUED"
        receipt = await stopline_dbos.cancel(
            h.ledger, second.workflow_id, by="user:42", reason="not this one"
        )
        assert await _status(second.workflow_id) == "CANCELLED"
        await DBOS.send_async(first.workflow_id, "go", "go")
        await first.get_result()
        with anyio.fail_after(30), pytest.raises(Exception, match="cancel"):
            await second.get_result()
        settled = await h.ledger.wait_settled(second.workflow_id, timeout=10)
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert receipt.cancelled_by == "user:42"
    assert len(h.provider.effects()) == 1  # the first's upload; the second sent nothing
    assert all(first.workflow_id in key for key in h.provider.effects())
    assert settled.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION


async def test_dbos_cancel_of_a_workflow_nobody_knows_is_unknown(
    backend: str, tmp_path: Path
) -> None:
    async with harness(backend, tmp_path) as h:
        with pytest.raises(Exception, match="unknown run"):
            await stopline_dbos.cancel(h.ledger, f"never-{uuid.uuid4().hex}", by="user:42")
