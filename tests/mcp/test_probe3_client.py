"""stopline's MCP client against stdio servers we did not write, each a raw JSON-RPC
script with a ground-truth log of the effects it really made:

- a 2025-11-25 tasks server whose ``tasks/get`` answers for another task: the answer
  says nothing of the task asked about, so the call is ``unknown`` (before, the
  client took the other task's state and result as its own: ``committed``, with a
  result that was never this call's);
- a tasks server whose process ends while its task is followed: the connection
  ended (``unknown``, cause transport), not "the task vanished" (server_error), and
  the next call is sent on a new connection (before, on the dead one: ``unknown``
  and a human review for a request no server ever read);
- a server that ends its output while no call is in flight: the connection is
  dropped at once, and the next call commits on a new one (before, it was written
  to the dead pipe and recorded ``unknown``).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

import stopline
from mcp import StdioServerParameters
from stopline import Cause, OpStatus, PhaseKind, Policy
from stopline.integrations.mcp import StoplineMCP, ToolPolicy
from tests.conftest import FAST_VERIFY
from tests.mcp.conftest import ROOT, server_env

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


_TASKS = """
import datetime as dt, json, os, sys

MODE, LOG = sys.argv[1], sys.argv[2]


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\\n")
    sys.stdout.flush()


def effect(tool, key):
    with open(LOG, "a") as f:
        f.write(json.dumps({"tool": tool, "key": key}) + "\\n")


def task(task_id, status):
    now = dt.datetime.now(dt.UTC).isoformat()
    return {"taskId": task_id, "status": status, "createdAt": now, "lastUpdatedAt": now,
            "ttl": 60000, "pollInterval": 10}


created, gets = 0, 0
for line in sys.stdin:
    m = json.loads(line)
    method, rid, params = m.get("method"), m.get("id"), m.get("params") or {}
    if rid is None:
        continue
    if method == "initialize":
        tasks = {"requests": {"tools": {"call": {}}}, "cancel": {}, "list": {}}
        out({"jsonrpc": "2.0", "id": rid, "result": {"protocolVersion": "2025-11-25",
             "capabilities": {"tools": {}, "tasks": tasks},
             "serverInfo": {"name": "odd", "version": "0"}}})
    elif method == "tools/list":
        upload = {"name": "upload", "inputSchema": {"type": "object"},
                  "execution": {"taskSupport": "optional"}}
        out({"jsonrpc": "2.0", "id": rid, "result": {"tools": [
            upload, {"name": "pay", "inputSchema": {"type": "object"}}]}})
    elif method == "tools/call" and params.get("name") == "pay":
        effect("pay", params["_meta"]["io.stopline/key"])
        paid = {"content": [{"type": "text", "text": "paid"}]}
        out({"jsonrpc": "2.0", "id": rid, "result": paid})
    elif method == "tools/call":
        created += 1
        effect("upload", f"t-{created}")
        out({"jsonrpc": "2.0", "id": rid, "result": {"task": task(f"t-{created}", "working")}})
    elif method == "tasks/get":
        gets += 1
        if MODE == "other-task":  # another client's task, done
            out({"jsonrpc": "2.0", "id": rid, "result": task("t-other", "completed")})
        elif gets >= 2:  # "dies": the process ends while the task is followed
            os._exit(1)
        else:
            out({"jsonrpc": "2.0", "id": rid, "result": task(params["taskId"], "working")})
    elif method == "tasks/result":
        text = f"the result of {params['taskId']}"
        out({"jsonrpc": "2.0", "id": rid, "result": {"content": [{"type": "text", "text": text}]}})
    else:
        out({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "no " + method}})
"""

_ENDS = """
import json, os, sys

LOG = sys.argv[2]


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\\n")
    sys.stdout.flush()


for line in sys.stdin:
    m = json.loads(line)
    method, rid, params = m.get("method"), m.get("id"), m.get("params") or {}
    if method == "initialize":
        out({"jsonrpc": "2.0", "id": rid, "result": {
            "protocolVersion": params["protocolVersion"], "capabilities": {"tools": {}},
            "serverInfo": {"name": "ends", "version": "0"}}})
    elif method == "tools/list":
        out({"jsonrpc": "2.0", "id": rid, "result": {"tools": [
            {"name": "pay", "inputSchema": {"type": "object"}},
            {"name": "bye", "inputSchema": {"type": "object"}}]}})
    elif method == "tools/call" and params.get("name") == "bye":
        out({"jsonrpc": "2.0", "id": rid, "result": {"content": []}})
        os.close(1)  # its output ends; the process goes on reading
        for _ in sys.stdin:
            pass
    elif method == "tools/call":
        with open(LOG, "a") as f:
            key = params["_meta"]["io.stopline/key"]
            f.write(json.dumps({"tool": "pay", "key": key}) + "\\n")
        paid = {"content": [{"type": "text", "text": "paid"}]}
        out({"jsonrpc": "2.0", "id": rid, "result": paid})
    elif rid is not None:
        out({"jsonrpc": "2.0", "id": rid, "result": {}})
"""


def _server(tmp_path: Path, source: str, *args: str) -> StdioServerParameters:
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(source))
    argv = [str(script), *args, str(tmp_path / "truth.jsonl")]
    return StdioServerParameters(command=sys.executable, args=argv, cwd=str(ROOT), env=server_env())


def _effects(tmp_path: Path, tool: str) -> list[str]:
    log = tmp_path / "truth.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return [e["key"] for e in map(json.loads, lines) if e["tool"] == tool]


POLICIES = {"upload": ToolPolicy(task=True, effects=True), "pay": ToolPolicy(effects=True)}


async def test_a_task_answer_for_another_task_is_no_answer_for_this_one(tmp_path: Path) -> None:
    """Asked about ``t-1``, the server answers ``t-other`` completed: nothing about t-1."""
    params = _server(tmp_path, _TASKS, "other-task")
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        StoplineMCP(params, name="odd", tasks=True, policies=POLICIES) as conn,
    ):
        async with ledger.run("upload", owner="user:1") as run:
            with pytest.raises(stopline.NoAnswer) as no_answer:
                await conn.call(run, "upload", {})
        op = (await ledger.backend.operations(run.id))[0]
        receipt = await ledger.wait_settled(run.id, timeout=30)
    assert _effects(tmp_path, "upload") == ["t-1"]
    assert no_answer.value.cause is Cause.SERVER_ERROR
    assert "t-other" in str(no_answer.value)
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
    assert not op.has_result  # never the other task's result
    assert "t-other" not in json.dumps(op.result)
    assert "completed" not in receipt.text().split("\n", 1)[1]


async def test_a_tasks_server_that_ends_mid_task_ends_the_connection(tmp_path: Path) -> None:
    """The process ends while its task is followed: the connection ended (transport),
    and the next call goes out on a new connection and commits."""
    params = _server(tmp_path, _TASKS, "dies")
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        StoplineMCP(params, name="odd", tasks=True, policies=POLICIES) as conn,
    ):
        async with ledger.run("upload", owner="user:1") as first:
            with pytest.raises(stopline.NoAnswer) as no_answer:
                await conn.call(first, "upload", {})
        async with ledger.run("pay", owner="user:1") as second:
            paid = await conn.call(second, "pay", {})
        upload = (await ledger.backend.operations(first.id))[0]
        pay = (await ledger.backend.operations(second.id))[0]
    assert no_answer.value.cause is Cause.TRANSPORT
    assert "vanished" not in str(no_answer.value)
    assert upload.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
    assert upload.cause is Cause.TRANSPORT
    assert paid == "paid" and pay.status is OpStatus.COMMITTED
    assert _effects(tmp_path, "pay") == [pay.id]
    assert conn.connections == 2


async def test_a_server_whose_output_ends_is_dropped_before_the_next_call(tmp_path: Path) -> None:
    """Its output ends while no call is in flight: the connection is dropped at once
    (a barrier: ``dropped``), and the next call commits on a new one."""
    params = _server(tmp_path, _ENDS, "ends")
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        StoplineMCP(params, name="ends", policies=POLICIES) as conn,
    ):
        first = conn.client
        await first.call_tool("bye", {})
        with anyio.fail_after(30):  # a bound, not a timing: before, it never was dropped
            while not conn.dropped(first):  # noqa: ASYNC110 (the SDK reader's, no event)
                await anyio.sleep(0.01)
        async with ledger.run("pay", owner="user:1") as run:
            paid = await conn.call(run, "pay", {})
        op = (await ledger.backend.operations(run.id))[0]
    assert paid == "paid" and op.status is OpStatus.COMMITTED
    assert _effects(tmp_path, "pay") == [op.id]
    assert conn.connections == 2


async def test_a_cancelled_task_at_server_everything_is_no_proof_of_nothing_done(
    tmp_path: Path,
) -> None:
    """``@modelcontextprotocol/server-everything`` (the TypeScript SDK's tasks, 2025-11-25):
    its research task, cut under ``immediate`` once created, answers ``tasks/cancel`` with
    ``cancelled`` while its work goes on to the end. The call is in doubt and goes to
    review: never ``not_committed``, and the cancel is recorded as a request."""
    tool = "simulate-research-query"
    target = StdioServerParameters(
        command="npx", args=["-y", "@modelcontextprotocol/server-everything", "stdio"]
    )
    policies = {tool: ToolPolicy(effects=True, settles_within=0.5)}
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger,
        StoplineMCP(target, name="everything", tasks=True, policies=policies) as conn,
    ):
        run_id = "research"

        async def workflow() -> None:
            async with (
                ledger.run("research", owner="user:1", run_id=run_id) as run,
                run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),
            ):
                await conn.call(run, tool, {"topic": "cancellation"})

        async with anyio.create_task_group() as tg:
            accepted = anyio.Event()
            conn.on_request = lambda key, request_id: accepted.set()
            tg.start_soon(workflow)
            await accepted.wait()  # the tools/call is written; now wait for its task
            while not any(
                op.status is OpStatus.ACCEPTED for op in await ledger.backend.operations(run_id)
            ):
                await ledger.wait_for_change(run_id)
            await ledger.cancel(run_id, by="user:1")  # immediate: the wait for the task is cut
        receipt = await ledger.wait_settled(run_id, timeout=60)
        op = (await ledger.backend.operations(run_id))[0]
        notes = [e.data for e in await ledger.backend.events(run_id) if e.op_id == op.id]
    assert op.status is OpStatus.NEEDS_REVIEW  # its work ran on: nothing proves it did not
    assert any(e.ref.startswith("task:") for e in op.evidence)
    requested = [n for n in notes if "task_id" in n]
    assert requested and "proves nothing" in str(requested[0]["detail"])
    assert "not committed" not in receipt.text().split("next:", 1)[0]
