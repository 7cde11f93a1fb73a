"""A 2025-11-25 tasks server we never saw (tests/support/odd_tasks_server.py, raw
JSON-RPC over stdio) answers with numbers and shapes no careful server sends.

Each odd answer is the call's own typed outcome; the connection and every other
run's call on it live. Before, a ``ttl`` of ``1e400`` failed the call as a
transport error and reopened the connection; a ``tasks/get`` answered ``{}``
while a cancelled task was followed, or a late answer whose ``content`` was no
list, raised in the connection's task group and cancelled the whole
``async with StoplineMCP`` block.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator

import anyio
import pytest

import stopline
from mcp import StdioServerParameters
from stopline import Cause, OpStatus, PhaseKind, Policy
from stopline.integrations.mcp import StoplineMCP, ToolPolicy
from tests.mcp.conftest import ROOT, server_env

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def connect(mode: str) -> AsyncIterator[StoplineMCP]:
    args = ["tests/support/odd_tasks_server.py", mode]
    params = StdioServerParameters(command=sys.executable, args=args, cwd=str(ROOT))
    params.env = server_env()
    # its reads say readOnlyHint, which the client does not trust (ADR 0055): declared here
    policies = {"upload": ToolPolicy(task=True), "lookup": ToolPolicy(effects=False)}
    async with StoplineMCP(params, name="odd", tasks=True, policies=policies) as conn:
        yield conn


async def read_in_flight(conn: StoplineMCP, ledger: stopline.Ledger, found: list[str]) -> None:
    """Another run's read, held by the server until it answers a ``tasks/get`` with ``{}``."""
    async with ledger.run("reader", owner="user:2") as run:
        found.append(await conn.call(run, "lookup", {}))


async def call_immediately(conn: StoplineMCP, run: stopline.Run, tool: str) -> None:
    """``tool`` in a phase a cancel stops at once."""
    async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
        await conn.call(run, tool, {})


async def cancel_once_accepted(ledger: stopline.Ledger, run_id: str) -> None:
    while not any(op.status is OpStatus.ACCEPTED for op in await ledger.backend.operations(run_id)):
        await ledger.wait_for_change(run_id)
    await ledger.cancel(run_id, by="user:1")


async def upload_unanswered(conn: StoplineMCP, ledger: stopline.Ledger) -> str:
    """``upload`` in a run of its own: no answer, from the server, and the operation in
    doubt; what the ``NoAnswer`` says."""
    async with ledger.run("upload", owner="user:1") as run:
        with pytest.raises(stopline.NoAnswer) as no_answer:
            await conn.call(run, "upload", {})
    assert no_answer.value.cause is Cause.SERVER_ERROR
    op = (await ledger.backend.operations(run.id))[0]
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
    return str(no_answer.value)


async def until_held(conn: StoplineMCP) -> None:
    """Until the server holds the read (it says so when asked; each ask is a round trip)."""
    while (await conn.client.call_tool("ctl_pending", {})).content[0].text != "1":  # type: ignore[union-attr]
        pass


async def test_a_task_with_a_ttl_no_float_holds_completes(ledger: stopline.Ledger) -> None:
    """``ttl`` and ``pollInterval`` of ``1e400``: read as not given; the task is
    followed to its end and the connection is not reopened."""
    async with connect("huge-ttl") as conn:
        async with ledger.run("upload", owner="user:1") as run:
            assert await conn.call(run, "upload", {}) == "done"
        op = (await ledger.backend.operations(run.id))[0]
        assert op.status is OpStatus.COMMITTED
        assert conn.connections == 1


async def test_an_answer_that_is_no_task_is_the_calls_own_outcome(
    ledger: stopline.Ledger,
) -> None:
    """``tasks/get`` answered ``{}``: the call has no answer, from the server
    (``unknown``, not a transport fault), and another run's read in flight on
    the same connection is answered."""
    async with connect("not-a-task") as conn:
        found: list[str] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_in_flight, conn, ledger, found)
            await until_held(conn)
            assert "not a task" in await upload_unanswered(conn, ledger)
        assert found == ["found"]
        assert conn.connections == 1


async def test_a_followed_task_that_answers_no_task_fails_alone(ledger: stopline.Ledger) -> None:
    """A cancelled task is followed in the background; its ``tasks/get`` is answered
    ``{}``. The follow ends with nothing proved (kept on the operation), the
    ``StoplineMCP`` block goes on, and another run's read in flight is answered."""
    async with connect("not-a-task-after-cancel") as conn:
        found: list[str] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_in_flight, conn, ledger, found)
            await until_held(conn)
            async with (
                ledger.run("upload", owner="user:1") as run,
                anyio.create_task_group() as calls,
            ):
                calls.start_soon(call_immediately, conn, run, "upload")
                calls.start_soon(cancel_once_accepted, ledger, run.id)
        assert found == ["found"]  # answered after the follow's failure, on the same connection
        while "not a task" not in str(await ledger.backend.events(run.id)):
            await ledger.wait_for_change(run.id)
        op = (await ledger.backend.operations(run.id))[0]
        assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)  # nothing proved
        assert conn.connections == 1
        async with ledger.run("after", owner="user:2") as later:
            assert await conn.call(later, "lookup", {}) == "found"


async def test_a_late_answer_with_odd_content_is_kept_and_fails_nothing(
    ledger: stopline.Ledger,
) -> None:
    """A cancelled call's answer comes late with ``content: 5`` (no list of blocks):
    it is a success, kept as the late result (R4), and the connection lives."""
    async with connect("huge-ttl") as conn:
        async with ledger.run("send", owner="user:1") as run, anyio.create_task_group() as tg:
            tg.start_soon(call_immediately, conn, run, "send")
            await until_held(conn)
            await ledger.cancel(run.id, by="user:1")
        op = (await ledger.backend.operations(run.id))[0]
        while op.status is not OpStatus.COMMITTED:
            await ledger.wait_for_change(run.id)
            op = (await ledger.backend.operations(run.id))[0]
        assert op.result == ""
        async with ledger.run("after", owner="user:2") as later:
            assert await conn.call(later, "lookup", {}) == "found"
        assert conn.connections == 1


async def test_a_created_task_with_no_id_is_unknown(ledger: stopline.Ledger) -> None:
    """The server says it created a task and gives no ``taskId``: the work may be
    running and cannot be followed; ``unknown``, and the connection is kept."""
    async with connect("no-task-id") as conn:
        assert "cannot be read" in await upload_unanswered(conn, ledger)
        assert conn.connections == 1
