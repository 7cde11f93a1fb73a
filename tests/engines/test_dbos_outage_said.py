"""What the health's warning says of a read of DBOS's system database that failed: the
problem, not SQLAlchemy's statement and parameters (ADR 0118). On a real DBOS over the
machine's PostgreSQL, DBOS's role refused the reading of its own table (a grant taken
away, for real): the read fails in its statement. (On SQLite a lock fails DBOS's read
as it begins its transaction, before any statement: probe 12's outage.)"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import anyio
import pytest
from dbos import DBOS, SetWorkflowID

from tests.engines import dbos_app
from tests.engines.dbos_harness import (
    MARKS,
    RoleLockedOut,
    outage_ready,
    running,
    until_opened,
    until_watch_failing,
)
from tests.engines.provider import FileProvider

pytestmark = MARKS[1:]


async def test_a_failed_read_of_dbos_database_is_said_without_its_statement(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A gated workflow waits in ``recv``; DBOS's role loses its grant on DBOS's
    ``workflow_status`` table, and the watcher's read of DBOS's cancels fails
    ("permission denied"). The health's warning and its ``last_error`` say so in one
    line (old: SQLAlchemy's ``[SQL: SELECT ...]``, every column of DBOS's listing, its
    parameters and a link, in the warning and in ``ledger.health``). The grant back,
    the workflow goes on."""
    caplog.set_level(logging.WARNING)
    with outage_ready("postgres", tmp_path) as (dbs, role):
        assert isinstance(role, RoleLockedOut)
        table = f'"{dbs.schema}".workflow_status'
        async with running(dbs, FileProvider(tmp_path / "effects.jsonl")) as h:
            workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
            with SetWorkflowID(workflow_id):
                handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["upload"], True)
            await until_opened(h, workflow_id)
            await anyio.to_thread.run_sync(
                role.admin, f'REVOKE SELECT ON {table} FROM "{role.role}"'
            )
            try:
                await until_watch_failing(h, True)
            finally:
                await anyio.to_thread.run_sync(
                    role.admin, f'GRANT SELECT ON {table} TO "{role.role}"'
                )
            last_error = h.ledger.health.steps["watch_dbos_cancels"].last_error
            await until_watch_failing(h, False)
            await DBOS.send_async(workflow_id, "ready", "go")
            with anyio.fail_after(30):
                await handle.get_result()
    [said] = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("stopline") and "watch_dbos_cancels failed" in r.getMessage()
    ]
    for told in (said, last_error):
        assert "permission denied" in told, told
        assert "[SQL:" not in told and "sqlalche.me" not in told, told  # old: both
        assert "\n" not in told, told


async def test_a_cancel_dbos_refused_is_said_without_its_statement(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stopline cancel of a waiting gated workflow while DBOS's role may not write
    DBOS's ``workflow_status``: the run is fenced, and carrying the cancel to DBOS fails
    ("permission denied"). The health's error and its ``last_error`` say so in one line
    (old: SQLAlchemy's ``[SQL: UPDATE ...]`` and its parameters). The grant back, the
    workflow's next step is refused at the gate and DBOS cancels it; nothing was sent."""
    caplog.set_level(logging.WARNING)
    with outage_ready("postgres", tmp_path) as (dbs, role):
        assert isinstance(role, RoleLockedOut)
        table = f'"{dbs.schema}".workflow_status'
        async with running(dbs, FileProvider(tmp_path / "effects.jsonl")) as h:
            workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
            with SetWorkflowID(workflow_id):
                handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["upload"], True)
            await until_opened(h, workflow_id)
            revoke = f'REVOKE UPDATE ON {table} FROM "{role.role}"'
            await anyio.to_thread.run_sync(role.admin, revoke)
            try:
                await h.ledger.cancel(workflow_id, by="user:42", reason="pressed stop")
                health = h.ledger.health
                with anyio.fail_after(30):
                    while "forward" not in health.steps:
                        await health.changed()
            finally:
                grant = f'GRANT UPDATE ON {table} TO "{role.role}"'
                await anyio.to_thread.run_sync(role.admin, grant)
            last_error = health.steps["forward"].last_error
            await DBOS.send_async(workflow_id, "ready", "go")
            with anyio.fail_after(30), pytest.raises(Exception, match="cancelled"):
                await handle.get_result()
            receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
    [said] = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("stopline") and "step forward failed" in r.getMessage()
    ]
    for told in (said, last_error):
        assert "permission denied" in told, told
        assert "[SQL:" not in told and "sqlalche.me" not in told, told  # old: both
        assert "\n" not in told, told
    assert receipt.cancelled_by == "user:42"
    assert h.provider.effects() == []
