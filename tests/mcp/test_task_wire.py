"""MCP tasks on the wire, to the letter, from the bare SDK client against stopline's server:
every method and shape of both eras (2026-07-28 extension, 2025-11-25 core) over stdio and
Streamable HTTP, the authorisation of every tasks request, and the races the spec names
(a cancel against the work finishing, a TTL that passed)."""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp.client import ClientExtension, NotificationBinding, advertise
from mcp.client.streamable_http import streamable_http_client
from pydantic import BaseModel, ConfigDict

from mcp import Client, MCPError
from stopline.integrations.mcp import KEY_META, OUTCOME_DATA, TASKS_EXTENSION
from stopline.integrations.mcp.tasks_client import raw_request
from tests.mcp.conftest import stdio_params

pytestmark = pytest.mark.timeout(40)
KEYS = itertools.count()
TASK_FIELDS_2026 = {"taskId", "status", "createdAt", "lastUpdatedAt", "ttlMs", "pollIntervalMs"}
TASK_FIELDS_2025 = {"taskId", "status", "createdAt", "lastUpdatedAt", "ttl", "pollInterval"}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def target(kind: str, tmp: Path, request: pytest.FixtureRequest) -> Any:
    if kind == "stdio":
        return stdio_params(tmp / "effects.db")
    return str(request.getfixturevalue("http_url"))


@pytest.fixture(scope="module", params=["stdio", "http"])
async def modern(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Client]:
    """A 2026-07-28 client that lists the tasks extension on every request."""
    where = target(str(request.param), tmp_path_factory.mktemp("wire"), request)
    async with Client(where, mode="2026-07-28", extensions=[advertise(TASKS_EXTENSION)]) as c:
        yield c


@pytest.fixture(scope="module", params=["stdio", "http"])
async def legacy(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Client]:
    where = target(str(request.param), tmp_path_factory.mktemp("wire"), request)
    async with Client(where, mode="legacy") as c:
        yield c


async def call(client: Client, method: str, **params: Any) -> dict[str, Any]:
    return await raw_request(client.session, method, params)


async def upload(client: Client, **extra: Any) -> dict[str, Any]:
    meta = {KEY_META: f"wire-{next(KEYS)}"}
    return await call(
        client, "tools/call", name="upload", arguments={"payload": "w"}, _meta=meta, **extra
    )


async def ctl(client: Client, name: str, **arguments: Any) -> Any:
    result = await client.call_tool(name, arguments)
    assert not result.is_error, result
    return result.structured_content


async def until_terminal(client: Client, task_id: str, *, outcome: bool = False) -> dict[str, Any]:
    """Poll tasks/get (the protocol offers polling only) until terminal (and, with
    ``outcome``, until the server says what the work did)."""
    for _ in range(2000):
        state = await call(client, "tasks/get", taskId=task_id)
        done = state["status"] in ("completed", "failed", "cancelled")
        if done and (not outcome or OUTCOME_DATA in state.get("_meta", {})):
            return state
        await anyio.sleep(0.01)
    raise AssertionError(f"task {task_id} never ended: {state}")


def iso(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def code(exc: pytest.ExceptionInfo[MCPError]) -> int:
    return exc.value.error.code


# -- 2026-07-28 ---------------------------------------------------------------------------------
async def test_task_wire_2026_create_is_flat_and_get_is_detailed(modern: Client) -> None:
    created = await upload(modern)
    assert created["resultType"] == "task"
    assert TASK_FIELDS_2026 <= set(created) <= TASK_FIELDS_2026 | {"resultType", "_meta"}
    assert created["status"] == "working" and len(created["taskId"]) >= 43  # 256 random bits
    assert iso(created["createdAt"]) <= iso(created["lastUpdatedAt"])
    done = await until_terminal(modern, created["taskId"])
    assert done["resultType"] == "complete" and done["status"] == "completed"
    assert done["result"]["structuredContent"]["value"] == "w"  # the CallToolResult, inline
    assert "error" not in done and "inputRequests" not in done
    assert done["_meta"][OUTCOME_DATA] == "committed"


async def test_task_wire_2026_the_server_decides_per_request(tmp_path: Path) -> None:
    """Without the extension in this request's capabilities: no task, ``params.task`` or not."""
    async with Client(stdio_params(tmp_path / "e.db"), mode="2026-07-28") as plain:
        inline = await upload(plain, task={"ttl": 1000})
    assert inline.get("resultType") in (None, "complete") and "taskId" not in inline
    assert inline["structuredContent"]["value"] == "w"


async def test_task_wire_2026_cancel_is_only_an_ack(modern: Client) -> None:
    """The cancel loses the race against work that cannot stop: acknowledged, still working,
    then completed (eventually consistent, not guaranteed to end cancelled)."""
    await ctl(modern, "ctl_hold", point="accepted:upload")
    created = await upload(modern)
    await ctl(modern, "ctl_reached", point="accepted:upload")
    ack = await call(modern, "tasks/cancel", taskId=created["taskId"])
    assert set(ack) - {"_meta"} == {"resultType"} and ack["resultType"] == "complete"
    assert (await call(modern, "tasks/get", taskId=created["taskId"]))["status"] == "working"
    await ctl(modern, "ctl_release", point="accepted:upload")
    final = await until_terminal(modern, created["taskId"])
    assert final["status"] == "completed" and final["_meta"][OUTCOME_DATA] == "committed"


async def test_task_wire_2026_cancel_before_the_effect_proves_it(modern: Client) -> None:
    await ctl(modern, "ctl_hold", point="received:upload")
    created = await upload(modern)
    await ctl(modern, "ctl_reached", point="received:upload")
    await call(modern, "tasks/cancel", taskId=created["taskId"])
    final = await until_terminal(modern, created["taskId"], outcome=True)
    await ctl(modern, "ctl_release", point="received:upload")
    assert final["status"] == "cancelled" and final["_meta"][OUTCOME_DATA] == "not_committed"


async def test_task_wire_2026_update_and_removed_methods(modern: Client) -> None:
    created = await upload(modern)
    update = await call(modern, "tasks/update", taskId=created["taskId"], inputResponses={"x": {}})
    assert update["resultType"] == "complete" and "taskId" not in update  # an empty ack
    for method in ("tasks/result", "tasks/list"):
        with pytest.raises(MCPError) as exc:
            await call(modern, method, taskId=created["taskId"])
        assert code(exc) == -32601  # removed in 2026-07-28


async def test_task_wire_unknown_id_and_capability(tmp_path: Path, modern: Client) -> None:
    with pytest.raises(MCPError) as unknown:
        await call(modern, "tasks/get", taskId="no-such-task")
    assert code(unknown) == -32602
    async with Client(stdio_params(tmp_path / "e.db"), mode="2026-07-28") as plain:
        with pytest.raises(MCPError) as undeclared:
            await call(plain, "tasks/get", taskId="no-such-task")
    assert code(undeclared) == -32021
    assert undeclared.value.error.data == {
        "requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}
    }


async def test_task_wire_http_authorises_every_tasks_request(http_url: str) -> None:
    """A task id is a bearer capability and not enough: another principal (another
    ``Authorization``) gets exactly "not found"; a ``Mcp-Name`` that is not the task id is
    refused."""

    async with contextlib.AsyncExitStack() as stack:

        async def client(token: str) -> Client:
            headers = {"Authorization": f"Bearer {token}"}
            http = await stack.enter_async_context(httpx2.AsyncClient(headers=headers, timeout=30))
            transport = streamable_http_client(http_url, http_client=http)
            extensions = [advertise(TASKS_EXTENSION)]
            return await stack.enter_async_context(
                Client(transport, mode="2026-07-28", extensions=extensions)
            )

        alice, mallory = await client("alice"), await client("mallory")
        created = await upload(alice)
        task_id = created["taskId"]
        assert (await call(alice, "tasks/get", taskId=task_id))["taskId"] == task_id
        for method in ("tasks/get", "tasks/cancel", "tasks/update"):
            with pytest.raises(MCPError) as foreign:
                await call(mallory, method, taskId=task_id, inputResponses={})
            assert code(foreign) == -32602 and foreign.value.error.message.endswith(task_id)
        with pytest.raises(MCPError) as misrouted:
            await raw_request(
                alice.session, "tasks/get", {"taskId": task_id}, headers={"Mcp-Name": "other"}
            )
        assert code(misrouted) == -32020
        await until_terminal(alice, task_id)


# -- 2025-11-25 ---------------------------------------------------------------------------------
async def test_task_wire_2025_capabilities_and_tool_execution(legacy: Client) -> None:
    tasks = legacy.server_capabilities.tasks
    assert tasks is not None and tasks.list is not None and tasks.cancel is not None
    assert tasks.requests is not None and tasks.requests.tools is not None
    assert tasks.requests.tools.call is not None
    tools = {t.name: t for t in (await legacy.list_tools()).tools}
    execution = tools["upload"].execution
    assert execution is not None and execution.task_support == "optional"
    assert tools["lookup"].execution is None  # forbidden (absent)


async def test_task_wire_2025_nested_create_get_result_list(legacy: Client) -> None:
    created = await upload(legacy, task={"ttl": 60_000})
    assert set(created) - {"_meta"} == {"task"}  # nested, no resultType "task"
    task = created["task"]
    assert set(task) == TASK_FIELDS_2025 and task["ttl"] == 60_000
    result = await call(legacy, "tasks/result", taskId=task["taskId"])  # blocks until terminal
    assert result["structuredContent"]["value"] == "w" and result.get("isError") is not True
    related = result["_meta"]["io.modelcontextprotocol/related-task"]
    assert related == {"taskId": task["taskId"]}
    state = await call(legacy, "tasks/get", taskId=task["taskId"])
    assert set(state) >= TASK_FIELDS_2025 and "ttlMs" not in state and "result" not in state
    assert state["status"] == "completed"
    listed = await call(legacy, "tasks/list")
    assert task["taskId"] in [t["taskId"] for t in listed["tasks"]]


async def test_task_wire_2025_list_is_paginated(tmp_path: Path) -> None:
    async with Client(stdio_params(tmp_path / "e.db"), mode="legacy") as client:
        ids = {(await upload(client, task={}))["task"]["taskId"] for _ in range(51)}
        first = await call(client, "tasks/list")
        second = await call(client, "tasks/list", cursor=first["nextCursor"])
    assert len(first["tasks"]) == 50 and "nextCursor" not in second
    assert {t["taskId"] for t in first["tasks"] + second["tasks"]} == ids


async def test_task_wire_2025_cancelled_stays_cancelled(legacy: Client) -> None:
    """tasks/cancel answers ``cancelled`` at once; the work finishes anyway and the status
    stays ``cancelled``: only io.stopline/outcome says it committed."""
    await ctl(legacy, "ctl_hold", point="accepted:upload")
    task_id = (await upload(legacy, task={}))["task"]["taskId"]
    await ctl(legacy, "ctl_reached", point="accepted:upload")
    cancelled = await call(legacy, "tasks/cancel", taskId=task_id)
    assert cancelled["status"] == "cancelled" and set(cancelled) >= TASK_FIELDS_2025
    with pytest.raises(MCPError) as again:
        await call(legacy, "tasks/cancel", taskId=task_id)
    assert code(again) == -32602  # already terminal
    await ctl(legacy, "ctl_release", point="accepted:upload")
    final = await until_terminal(legacy, task_id, outcome=True)
    assert final["status"] == "cancelled" and final["_meta"][OUTCOME_DATA] == "committed"
    with pytest.raises(MCPError) as payload:
        await call(legacy, "tasks/result", taskId=task_id)
    data = payload.value.error.data
    assert code(payload) == -32800 and data[OUTCOME_DATA] == "committed"
    assert data["io.stopline/result"]["structuredContent"]["value"] == "w"


async def test_task_wire_2025_ttl_passed_is_not_found(legacy: Client) -> None:
    task_id = (await upload(legacy, task={"ttl": 1}))["task"]["taskId"]
    await anyio.sleep(0.01)  # past the 1 ms TTL: a time bound, not a barrier
    with pytest.raises(MCPError) as expired:
        await call(legacy, "tasks/get", taskId=task_id)
    assert code(expired) == -32602


class _Pushed(BaseModel):
    model_config = ConfigDict(extra="allow")


class _TaskNotes(ClientExtension):
    """The tasks extension, plus a binding that keeps every ``notifications/tasks``."""

    identifier = TASKS_EXTENSION

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.arrived = anyio.Event()

    def notifications(self) -> list[NotificationBinding[Any]]:
        return [
            NotificationBinding(method="notifications/tasks", params_type=_Pushed, handler=self._on)
        ]

    async def _on(self, params: _Pushed) -> None:
        self.seen.append(params.model_dump())
        arrived, self.arrived = self.arrived, anyio.Event()
        arrived.set()

    async def until(self, status: str) -> dict[str, Any]:
        while not (found := [n for n in self.seen if n["status"] == status]):
            await self.arrived.wait()
        return found[-1]


@pytest.mark.parametrize("kind", ["stdio", "http"])
async def test_task_wire_2026_notifications_over_listen(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``subscriptions/listen`` with ``taskIds``: the ack names the tasks the server will
    report on (only the caller's own), then each change arrives as ``notifications/tasks``
    carrying the whole DetailedTask."""
    notes = _TaskNotes()
    async with Client(target(kind, tmp_path, request), mode="2026-07-28", extensions=[notes]) as c:
        await ctl(c, "ctl_hold", point="accepted:upload")
        created = await upload(c)
        await ctl(c, "ctl_reached", point="accepted:upload")
        listen = {"notifications": {"taskIds": [created["taskId"], "someone-elses"]}}
        async with anyio.create_task_group() as tg:
            tg.start_soon(raw_request, c.session, "subscriptions/listen", listen)
            working = await notes.until("working")
            await ctl(c, "ctl_release", point="accepted:upload")
            completed = await notes.until("completed")
            tg.cancel_scope.cancel()  # closing the listen stream ends the subscription
    assert working["taskId"] == created["taskId"] and "result" not in working
    assert completed["result"]["structuredContent"]["value"] == "w"
    assert completed["_meta"][OUTCOME_DATA] == "committed"
    assert "io.modelcontextprotocol/subscriptionId" in completed["_meta"]
    assert {n["taskId"] for n in notes.seen} == {created["taskId"]}
