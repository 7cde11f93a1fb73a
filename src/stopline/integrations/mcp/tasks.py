"""MCP tasks on the server, both eras (see ``_task_wire`` for the two shapes).

    tasks = TasksServer(effects=effects, tools={"upload": "optional"})
    server = MCPServer("payments", extensions=[tasks], lifespan=tasks.lifespan)
    tasks.install(server)  # the 2025-11-25 half, and the listen stream for notifications/tasks

- **2026-07-28** (``io.modelcontextprotocol/tasks``): the server decides per
  request. A tool listed in ``tools`` becomes a task when *this request's*
  ``_meta["io.modelcontextprotocol/clientCapabilities"].extensions`` lists the
  extension (a ``required`` tool without it is refused with -32021); the old
  ``params.task`` is ignored. ``tasks/get`` answers a ``DetailedTask``,
  ``tasks/update`` and ``tasks/cancel`` an empty acknowledgement;
  ``subscriptions/listen`` with ``taskIds`` pushes ``notifications/tasks``.
- **2025-11-25** (core, experimental): the client asks with ``params.task``;
  ``tasks/get``, ``tasks/result`` (blocks until terminal), ``tasks/list``
  (paginated) and ``tasks/cancel`` (the task is ``cancelled`` before the answer,
  and stays so whatever the work then does).

Both: a task is registered before ``CreateTaskResult`` leaves, so a
``tasks/get`` right after it resolves; ids are 256-bit random
(``secrets.token_urlsafe(32)``); every tasks request is authorised against
the principal that created the task (``principal(ctx)``: the access token's
client, else a digest of the ``Authorization`` header, else the connection's
one peer), and a task of another principal is reported exactly like a
missing one. Over HTTP a ``Mcp-Name`` header that differs from the
``taskId`` is refused (-32020). A task past its TTL is purged: "not found".

What really happened rides on every task as ``_meta["io.stopline/outcome"]``
once the work ended: the ``Effects`` record's verdict for the request's key
when there is one, else what the answer itself proves.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import anyio
import mcp_types as types
from anyio.abc import TaskGroup
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import Extension, MCPServer, MethodBinding
from mcp.shared.inbound import MCP_NAME_HEADER, decode_header_value
from mcp_types import CLIENT_CAPABILITIES_META_KEY
from mcp_types.jsonrpc import HEADER_MISMATCH, MISSING_REQUIRED_CLIENT_CAPABILITY
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel

from mcp import MCPError
from stopline.integrations.mcp._task_state import ServerTask, TaskIdParams, UpdateParams
from stopline.integrations.mcp._task_wire import LEGACY, MODERN, TERMINAL, Era, millis
from stopline.integrations.mcp._vocab import KEY_META, OUTCOME_DATA, TASKS_EXTENSION

if TYPE_CHECKING:
    from stopline.integrations.mcp.server import Effects

__all__ = ["TaskSupport", "TasksServer", "default_principal"]

TaskSupport = Literal["optional", "required"]
Principal = Callable[[ServerRequestContext[Any, Any]], str]
_PAGE = 50


def default_principal(ctx: ServerRequestContext[Any, Any]) -> str:
    """Who asks: the access token's client, else the ``Authorization`` header, else the peer."""
    from mcp.server.auth.middleware.auth_context import get_access_token

    token = get_access_token()
    if token is not None:
        return f"client:{token.client_id}"
    headers = getattr(ctx.request, "headers", None)
    auth = headers.get("authorization") if headers is not None else None
    if auth:
        return "auth:" + hashlib.sha256(auth.encode()).hexdigest()
    return "peer"  # stdio's one client, or an unauthenticated HTTP endpoint


def _not_found(task_id: str) -> MCPError:
    return MCPError(code=types.INVALID_PARAMS, message=f"Task not found: {task_id}")


def _missing_capability(what: str) -> MCPError:
    return MCPError(
        code=MISSING_REQUIRED_CLIENT_CAPABILITY,
        message=f"{what} needs the client capability {TASKS_EXTENSION!r}",
        data={"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}},
    )


def declares_tasks(ctx: ServerRequestContext[Any, Any]) -> bool:
    """Whether *this request* lists the tasks extension in its per-request capabilities."""
    meta = cast(dict[str, Any], ctx.meta or {})
    caps = meta.get(CLIENT_CAPABILITIES_META_KEY)
    extensions = caps.get("extensions") if isinstance(caps, dict) else None
    return isinstance(extensions, dict) and TASKS_EXTENSION in extensions


def _era(ctx: ServerRequestContext[Any, Any]) -> Era:
    return MODERN if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS else LEGACY


class TasksServer(Extension):
    """The tasks runtime: ``MCPServer(extensions=[tasks], lifespan=tasks.lifespan)``."""

    identifier = TASKS_EXTENSION

    def __init__(
        self,
        *,
        effects: Effects | None = None,
        tools: Mapping[str, TaskSupport] | None = None,
        default_ttl_ms: int = 600_000,
        poll_interval_ms: int = 50,
        principal: Principal = default_principal,
    ) -> None:
        self.effects = effects
        self.task_tools = dict(tools or {})  # tools that may run as tasks, and how
        self.default_ttl_ms = default_ttl_ms
        self.poll_interval_ms = poll_interval_ms
        self.principal = principal
        self.tasks: dict[str, ServerTask] = {}
        self._changed = anyio.Event()  # set and replaced on every status change
        self._tg: TaskGroup | None = None

    # -- wiring -------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, server: MCPServer[Any]) -> AsyncIterator[dict[str, Any]]:
        """Owns the task group the tasks run in (they outlive their ``tools/call``)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            yield {}
            tg.cancel_scope.cancel()

    def install(self, server: MCPServer[Any]) -> None:
        """Add the middleware for the 2025-11-25 half and for task notifications."""
        server.middleware.append(self.middleware)

    def settings(self) -> dict[str, Any]:
        return {}

    def methods(self) -> Sequence[MethodBinding]:
        modern, legacy = frozenset(MODERN_PROTOCOL_VERSIONS), frozenset([LEGACY])
        return [
            MethodBinding("tasks/get", TaskIdParams, self._get),
            MethodBinding("tasks/cancel", TaskIdParams, self._cancel),
            MethodBinding("tasks/update", UpdateParams, self._update, protocol_versions=modern),
            MethodBinding("tasks/result", TaskIdParams, self._result, protocol_versions=legacy),
            MethodBinding(
                "tasks/list", types.PaginatedRequestParams, self._list, protocol_versions=legacy
            ),
        ]

    # -- creating a task -------------------------------------------------------------
    async def intercept_tool_call(
        self,
        params: types.CallToolRequestParams,
        ctx: ServerRequestContext[Any, Any],
        call_next: CallNext,
    ) -> HandlerResult:
        """2026-07-28: the server decides whether this call becomes a task."""
        support = self.task_tools.get(params.name)
        if support is None or _era(ctx) != MODERN:
            return await call_next(ctx)
        if not declares_tasks(ctx):
            if support == "required":
                raise _missing_capability(f"tool {params.name!r} runs only as a task")
            return await call_next(ctx)
        task = self._start(ctx, call_next, params.name, MODERN, None)
        return task.created()

    async def middleware(
        self, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        """2025-11-25 task creation and capability advertisement; 2026 listen streams."""
        if ctx.method == "subscriptions/listen" and _era(ctx) == MODERN:
            wanted = ((ctx.params or {}).get("notifications") or {}).get("taskIds")
            if wanted is not None:
                return await self._listen(ctx, wanted)
        if _era(ctx) != LEGACY:
            return await call_next(ctx)
        if ctx.method == "initialize":
            out = cast(dict[str, Any], await call_next(ctx))
            caps = out.setdefault("capabilities", {})
            caps["tasks"] = {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}
            return out
        if ctx.method == "tools/list":
            out = cast(dict[str, Any], await call_next(ctx))
            for tool in out.get("tools", []):
                if tool.get("name") in self.task_tools:
                    tool["execution"] = {"taskSupport": self.task_tools[tool["name"]]}
            return out
        if ctx.method != "tools/call":
            return await call_next(ctx)
        params = ctx.params or {}
        name, ask = params.get("name"), params.get("task")
        support = self.task_tools.get(name) if isinstance(name, str) else None
        if ask is None:
            if support == "required":
                raise MCPError(code=types.METHOD_NOT_FOUND, message=f"{name!r} runs only as a task")
            return await call_next(ctx)
        if support is None:
            return await call_next(ctx)  # a receiver that does not task a request ignores it
        ttl = millis(ask.get("ttl")) if isinstance(ask, dict) else None
        task = self._start(ctx, call_next, str(name), LEGACY, ttl)
        return task.created()

    def _start(
        self,
        ctx: ServerRequestContext[Any, Any],
        call_next: CallNext,
        tool: str,
        era: Era,
        ttl_ms: int | None,
    ) -> ServerTask:
        if self._tg is None:
            raise MCPError(code=types.INTERNAL_ERROR, message="tasks need TasksServer.lifespan")
        meta = cast(dict[str, Any], ctx.meta or {})
        key = meta.get(KEY_META) if isinstance(meta.get(KEY_META), str) else None
        now = time.time()
        task = ServerTask(
            task_id=secrets.token_urlsafe(32),
            owner=self.principal(ctx),
            era=era,
            tool=tool,
            key=key,
            created_at=now,
            last_updated_at=now,
            # asked for, up to ours; none, 0 or less (purged at once, unread) is ours
            ttl_ms=min(ttl_ms, self.default_ttl_ms)
            if ttl_ms and ttl_ms > 0
            else self.default_ttl_ms,
            poll_interval_ms=self.poll_interval_ms,
        )
        self.tasks[task.task_id] = task  # durable for this process before the answer leaves
        self._tg.start_soon(self._work, task, ctx, call_next)
        return task

    async def _work(
        self, task: ServerTask, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> None:
        try:
            with task.scope:
                try:
                    out = await call_next(ctx)
                except MCPError as exc:
                    await self._ended(
                        task, error=exc.error.model_dump(mode="json", exclude_none=True)
                    )
                    return
                except Exception as exc:
                    await self._ended(
                        task, error={"code": types.INTERNAL_ERROR, "message": repr(exc)}
                    )
                    return
                dumped = (
                    out.model_dump(by_alias=True, mode="json", exclude_none=True)
                    if isinstance(out, BaseModel)
                    else dict(cast(dict[str, Any], out))
                )
                dumped.pop("resultType", None)  # the payload is a CallToolResult
                await self._ended(task, result=dumped)
        finally:
            if not task.ended.is_set():  # interrupted (tasks/cancel, or the server stopping)
                with anyio.CancelScope(shield=True):
                    await self._ended(task, interrupted=True)

    async def _ended(
        self,
        task: ServerTask,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        interrupted: bool = False,
    ) -> None:
        outcome = await self._outcome(task, result, error)
        task.finish(result=result, error=error, interrupted=interrupted, outcome=outcome)
        self._touch()

    async def _outcome(
        self, task: ServerTask, result: dict[str, Any] | None, error: dict[str, Any] | None
    ) -> str | None:
        """What the work did: the durable record first, else what the answer proves."""
        if self.effects is not None and task.key is not None:
            with anyio.CancelScope(shield=True):
                status = await self.effects.status(task.key)
            if status.get("state") != "unknown_key":
                return str(status.get("verdict") or "unknown")
        if result is not None and not result.get("isError"):
            return "committed"
        data = (error or {}).get("data")
        proven = data.get(OUTCOME_DATA) if isinstance(data, dict) else None
        return proven if isinstance(proven, str) else None

    def _touch(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    # -- finding a task: authorised, routed, alive ----------------------------------------
    def forget(self, task_id: str) -> None:
        """Drop a task as its TTL would (tests use this to make a task vanish)."""
        self.tasks.pop(task_id, None)

    def _find(self, ctx: ServerRequestContext[Any, Any], task_id: str) -> ServerTask:
        if _era(ctx) == MODERN and not declares_tasks(ctx):
            raise _missing_capability(ctx.method)
        headers = getattr(ctx.request, "headers", None)
        routed = headers.get(MCP_NAME_HEADER) if headers is not None else None
        if routed is not None and decode_header_value(routed) != task_id:
            raise MCPError(code=HEADER_MISMATCH, message="Mcp-Name does not match params.taskId")
        task = self.tasks.get(task_id)
        if task is not None and task.expired(time.time()):
            self.forget(task_id)
            task = None
        if task is None or task.owner != self.principal(ctx):
            raise _not_found(task_id)  # another principal's task is reported as missing
        return task

    # -- the methods -----------------------------------------------------------------
    async def _get(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams) -> Any:
        task = self._find(ctx, params.task_id)
        return task.detailed() if _era(ctx) == MODERN else task.legacy()

    async def _cancel(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams) -> Any:
        task = self._find(ctx, params.task_id)
        if _era(ctx) == MODERN:  # an acknowledgement; the work ends when it ends
            if not task.ended.is_set():
                task.cancel_requested = True
                task.scope.cancel()
            return {}
        if task.status in TERMINAL:
            raise MCPError(
                code=types.INVALID_PARAMS, message=f"task {task.task_id} is already {task.status}"
            )
        task.cancel_legacy()  # cancelled now, and it stays so whatever the work does
        self._touch()
        return task.legacy()

    async def _update(self, ctx: ServerRequestContext[Any, Any], params: UpdateParams) -> Any:
        self._find(ctx, params.task_id)
        return {}  # stopline's tasks never ask for input: every response is for no open request

    async def _result(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams) -> Any:
        task = self._find(ctx, params.task_id)
        while task.status not in TERMINAL:
            await task.changed()
        return task.payload()

    async def _list(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams
    ) -> Any:
        owner, now = self.principal(ctx), time.time()
        mine = [t for t in self.tasks.values() if t.owner == owner and not t.expired(now)]
        start = int(params.cursor) if params.cursor and params.cursor.isdigit() else 0
        page = mine[start : start + _PAGE]
        out: dict[str, Any] = {"tasks": [t.legacy() for t in page]}
        if start + _PAGE < len(mine):
            out["nextCursor"] = str(start + _PAGE)
        return out

    async def _listen(self, ctx: ServerRequestContext[Any, Any], wanted: Any) -> HandlerResult:
        """``subscriptions/listen`` with ``taskIds``: push ``notifications/tasks`` on change."""
        if not declares_tasks(ctx):
            raise _missing_capability("task notifications")
        owner = self.principal(ctx)
        ids = [i for i in wanted if isinstance(i, str)] if isinstance(wanted, list) else []
        honored = [i for i in ids if (t := self.tasks.get(i)) is not None and t.owner == owner]
        sub: dict[str, Any] = {"io.modelcontextprotocol/subscriptionId": ctx.request_id}
        outbound = ctx.session
        await outbound.send_notification(
            cast(
                Any,
                _Note(
                    method="notifications/subscriptions/acknowledged",
                    params={"notifications": {"taskIds": honored}, "_meta": sub},
                ),
            ),
            related_request_id=ctx.request_id,
        )
        seen: dict[str, tuple[str, str | None]] = {}
        while True:
            changed = self._changed
            for task_id in honored:
                task = self.tasks.get(task_id)
                if task is None or seen.get(task_id) == (task.status, task.outcome):
                    continue
                seen[task_id] = (task.status, task.outcome)
                body = {**task.detailed(), "_meta": {**task.meta(), **sub}}
                body.pop("resultType", None)
                await outbound.send_notification(
                    cast(Any, _Note(method="notifications/tasks", params=body)),
                    related_request_id=ctx.request_id,
                )
            await changed.wait()


class _Note(BaseModel):
    """A notification the SDK's typed unions do not know (the extension's own)."""

    method: str
    params: dict[str, Any]
