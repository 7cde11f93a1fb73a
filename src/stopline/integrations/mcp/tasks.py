"""The MCP tasks extension (``io.modelcontextprotocol/tasks``, 2026-07-28), both ends.

The SDK 2.3 ships no tasks runtime, so this builds one on its extension hooks
(``Extension``/``MethodBinding`` on the server, ``ClientExtension``/
``ResultClaim`` on the client). A ``tools/call`` whose ``_meta`` carries
``"io.modelcontextprotocol/task": {"ttl": ms}`` returns at once with a claimed
result ``{"resultType": "task", "task": {...}}``; the client polls
``tasks/get`` until the task is terminal.

Truthful semantics:

- ``tasks/cancel`` is an acknowledgement only. The server records that a
  cancel was *requested* and asks the work to stop; the task's status stays
  ``working`` until the work really ends, and the final status may be
  ``completed`` or ``failed`` as well as ``cancelled``.
- The client records the cancel as a request (a ledger note), never as an
  outcome, and keeps polling ``tasks/get`` to a terminal state in the
  background; what it finds is attached to the operation (R4).
- A task the server no longer knows (TTL expired, restarted) is ``unknown``:
  kept as evidence, reconciled by read-back or review, never "cancelled".
- ``cancelled`` counts as "did not happen" only when the server says the
  work stopped before any effect (``outcome: not_committed``, which the
  server sets from its ``Effects`` record).
"""

from __future__ import annotations

import contextvars
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal, cast

import anyio
import mcp_types as types
from anyio.abc import TaskGroup
from mcp.client import ClaimContext, ClientExtension, ResultClaim
from mcp.client.session import ClientSession
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import Extension, MCPServer, MethodBinding, require_client_extension
from pydantic import BaseModel

from mcp import MCPError
from stopline.domain.vocab import Cause
from stopline.integrations.mcp._vocab import KEY_META, OUTCOME_DATA, TASK_META, TASKS_EXTENSION
from stopline.runtime.context import CallContext
from stopline.runtime.tool import NoAnswer

if TYPE_CHECKING:
    from stopline.integrations.mcp.server import Effects

__all__ = ["CURRENT_CALL", "TaskCreated", "TaskState", "TasksClient", "TasksServer"]

TaskStatus = Literal["working", "completed", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"completed", "failed", "cancelled"})

CURRENT_CALL: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar(
    "stopline_mcp_call", default=None
)
"""The gated call a ``tools/call`` belongs to (set by the client wrapper around the call)."""


class TaskIdParams(types.RequestParams):
    task_id: str


class TaskInfo(BaseModel):
    task_id: str
    status: TaskStatus
    status_message: str | None = None
    cancel_requested: bool = False
    outcome: str | None = None  # "not_committed" when the work provably did nothing
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    created_at: float
    last_updated_at: float
    ttl: int | None = None


class TaskCreated(types.Result):
    """The claimed ``tools/call`` result: the call became a task."""

    result_type: Literal["task"] = "task"
    task: TaskInfo


class TaskState(types.Result):
    task: TaskInfo


class _Get(types.Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: TaskIdParams


class _Cancel(types.Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    params: TaskIdParams


# -- server ---------------------------------------------------------------------------------
class TasksServer(Extension):
    """Server side: ``MCPServer(extensions=[tasks], lifespan=tasks.lifespan)``."""

    identifier = TASKS_EXTENSION

    def __init__(self, *, effects: Effects | None = None, default_ttl_ms: int = 600_000) -> None:
        self.effects = effects
        self.default_ttl_ms = default_ttl_ms
        self.tasks: dict[str, TaskInfo] = {}
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._tg: TaskGroup | None = None

    @asynccontextmanager
    async def lifespan(self, server: MCPServer[Any]) -> AsyncIterator[dict[str, Any]]:
        """Owns the task group the tasks run in (they outlive their ``tools/call``)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            yield {}
            tg.cancel_scope.cancel()

    def settings(self) -> dict[str, Any]:
        return {"cancel": "acknowledgement; poll tasks/get for the final state"}

    def methods(self) -> Sequence[MethodBinding]:
        return [
            MethodBinding("tasks/get", TaskIdParams, self._get),
            MethodBinding("tasks/cancel", TaskIdParams, self._cancel),
        ]

    async def intercept_tool_call(
        self,
        params: types.CallToolRequestParams,
        ctx: ServerRequestContext[Any, Any],
        call_next: CallNext,
    ) -> HandlerResult:
        meta = cast(dict[str, Any], ctx.meta or {})
        if TASK_META not in meta:
            return await call_next(ctx)
        require_client_extension(ctx, self.identifier)
        if self._tg is None:
            raise MCPError(code=types.INTERNAL_ERROR, message="tasks need TasksServer.lifespan")
        ask = meta.get(TASK_META)
        ttl = ask.get("ttl") if isinstance(ask, dict) else None
        now = time.time()
        info = TaskInfo(
            task_id=uuid.uuid4().hex,
            status="working",
            created_at=now,
            last_updated_at=now,
            ttl=ttl if isinstance(ttl, int) else self.default_ttl_ms,
        )
        self.tasks[info.task_id] = info
        scope = self._scopes[info.task_id] = anyio.CancelScope()
        key = meta.get(KEY_META)
        self._tg.start_soon(self._work, info, scope, ctx, call_next, key)
        return TaskCreated(task=info.model_copy())

    async def _work(
        self,
        info: TaskInfo,
        scope: anyio.CancelScope,
        ctx: ServerRequestContext[Any, Any],
        call_next: CallNext,
        key: Any,
    ) -> None:
        try:
            with scope:
                try:
                    out = await call_next(ctx)
                except MCPError as exc:
                    self._end(info, "failed", error=exc.error.model_dump(mode="json"))
                    return
                except Exception as exc:
                    self._end(info, "failed", error={"code": -32603, "message": repr(exc)})
                    return
                dumped = (
                    out.model_dump(by_alias=True, mode="json", exclude_none=True)
                    if isinstance(out, BaseModel)
                    else cast(dict[str, Any], out)
                )
                self._end(info, "failed" if dumped.get("isError") else "completed", result=dumped)
        finally:
            if info.status == "working":  # the work was interrupted by tasks/cancel
                outcome = await self._outcome_of(key)
                self._end(info, "cancelled", outcome=outcome)
            self._scopes.pop(info.task_id, None)

    async def _outcome_of(self, key: Any) -> str | None:
        if self.effects is None or not isinstance(key, str):
            return None  # nobody can tell what an interrupted tool did
        with anyio.CancelScope(shield=True):
            status = await self.effects.status(key)
        return "not_committed" if status.get("verdict") == "not_committed" else None

    def _end(self, info: TaskInfo, status: TaskStatus, **fields: Any) -> None:
        info.status = status
        info.last_updated_at = time.time()
        for name, value in fields.items():
            setattr(info, name, value)

    def forget(self, task_id: str) -> None:
        """Drop a task as its TTL would (tests use this to make a task vanish)."""
        self.tasks.pop(task_id, None)

    def _find(self, task_id: str) -> TaskInfo:
        info = self.tasks.get(task_id)
        if (
            info is not None
            and info.ttl is not None
            and time.time() > info.created_at + info.ttl / 1000
        ):
            self.forget(task_id)
            info = None
        if info is None:
            raise MCPError(code=types.INVALID_PARAMS, message=f"unknown task {task_id!r}")
        return info

    async def _get(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams) -> TaskState:
        return TaskState(task=self._find(params.task_id).model_copy())

    async def _cancel(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams) -> TaskState:
        info = self._find(params.task_id)
        if info.status == "working":
            info.cancel_requested = True  # an acknowledgement, not an outcome
            info.last_updated_at = time.time()
            scope = self._scopes.get(info.task_id)
            if scope is not None:
                scope.cancel()
        return TaskState(task=info.model_copy())


# -- client ---------------------------------------------------------------------------------
FinalFn = Callable[[CallContext, TaskInfo | None, str], Any]


class TasksClient(ClientExtension):
    """Client side: resolves claimed task results by polling ``tasks/get``."""

    identifier = TASKS_EXTENSION

    def __init__(
        self,
        *,
        spawn: Callable[..., None],
        on_final: FinalFn,
        poll: float = 0.05,
        follow_timeout: float = 300.0,
    ) -> None:
        self.follow_timeout = follow_timeout  # how long a cancelled task is followed
        self._spawn = spawn  # start a background task (the connection's task group)
        self._on_final = on_final  # (call, final state or None if vanished, detail)
        self.poll = poll

    def claims(self) -> Sequence[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=TaskCreated, resolve=self._resolve)]

    async def _resolve(self, created: TaskCreated, cctx: ClaimContext) -> types.CallToolResult:
        call = CURRENT_CALL.get()
        task_id = created.task.task_id
        if call is not None:
            await call.accepted(ref=f"task:{task_id}", detail="the server created a task")
        try:
            info = await self._until_terminal(cctx.session, task_id)
        except MCPError as exc:  # the task vanished (TTL, restart): nobody knows its outcome
            raise NoAnswer(Cause.SERVER_ERROR, f"task {task_id} vanished: {exc.message}") from exc
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await self._ask_cancel(cctx.session, task_id, call)
            if call is not None:
                self._spawn(self._follow, cctx.session, task_id, call)
            raise
        return _to_result(info)

    async def _until_terminal(self, session: ClientSession, task_id: str) -> TaskInfo:
        while True:
            state = await session.send_request(
                _Get(params=TaskIdParams(task_id=task_id)), TaskState
            )
            if state.task.status in TERMINAL:
                return state.task
            await anyio.sleep(self.poll)  # the protocol offers polling only

    async def _ask_cancel(
        self, session: ClientSession, task_id: str, call: CallContext | None
    ) -> None:
        try:
            state = await session.send_request(
                _Cancel(params=TaskIdParams(task_id=task_id)), TaskState
            )
            detail = f"status {state.task.status} after the request"
        except MCPError as exc:
            detail = f"tasks/cancel failed: {exc.message}"
        if call is not None:  # a request, not an outcome
            await call._ledger.backend.note(
                call.op_id, "task_cancel_requested", {"task_id": task_id, "detail": detail}
            )

    async def _follow(self, session: ClientSession, task_id: str, call: CallContext) -> None:
        """After a cancel: poll to a terminal state and report what really happened."""
        info: TaskInfo | None = None
        detail = f"task {task_id} still working after {self.follow_timeout}s"
        try:
            with anyio.move_on_after(self.follow_timeout):
                info = await self._until_terminal(session, task_id)
                detail = f"task {task_id} ended {info.status}"
        except MCPError as exc:
            info, detail = None, f"task {task_id} vanished: {exc.message}"
        await self._on_final(call, info, detail)


def _to_result(info: TaskInfo) -> types.CallToolResult:
    if info.status == "completed" and info.result is not None:
        return types.CallToolResult.model_validate(info.result)
    if info.status == "cancelled" and info.outcome == "not_committed":
        raise MCPError(
            code=-32090,
            message=f"task {info.task_id} was cancelled before any effect",
            data={OUTCOME_DATA: "not_committed"},
        )
    if info.error is not None:
        raise MCPError(
            code=int(info.error.get("code", -32603)),
            message=str(info.error.get("message", "task failed")),
            data=info.error.get("data"),
        )
    if info.result is not None:
        return types.CallToolResult.model_validate(info.result)
    raise MCPError(code=-32603, message=f"task {info.task_id} ended {info.status}; outcome unknown")
