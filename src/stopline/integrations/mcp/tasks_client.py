"""MCP tasks on the client, both eras: a task-backed ``tools/call`` as one operation.

- **2026-07-28**: ``TasksClient`` is a ``ClientExtension``: the SDK lists
  ``io.modelcontextprotocol/tasks`` in every request's ``_meta`` and hands a
  ``resultType: "task"`` answer to ``_resolve``. The server decides; nothing
  on the request asks for a task.
- **2025-11-25**: the client asks, with ``params.task``, for a tool whose
  listing says ``execution.taskSupport`` and a server whose capabilities list
  ``tasks.requests.tools.call`` (``call_legacy``).

Either way: creating the task records ``accepted`` (ref ``task:<id>``); the
client polls ``tasks/get`` at the server's ``pollIntervalMs``; a terminal task
says what it proves (``TaskOutcome``). From the task's creation its call's
cancel goes by ``tasks/cancel`` (its channel in the record). A cancel of the
awaiting scope sends ``tasks/cancel``, records it as a *request* (the
``task_cancel_requested`` note: in 2026 an acknowledgement, in 2025 a status
that proves nothing about the work; a JSON-RPC error is the provider's answer,
``CancelState.ERROR``, kept in ``TaskCancel`` for the call's ask, ADR 0083),
and keeps following the task in the background; its final state is attached
to the operation (R4). A task the server no longer knows, or past its TTL, is
``unknown`` and goes to read-back: never "cancelled".
"""

from __future__ import annotations

import collections
import contextvars
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import anyio
import mcp_types as types
from mcp.client import ClaimContext, ClientExtension, ResultClaim
from mcp.client.session import ClientSession
from mcp.shared.dispatcher import CallOptions, ProgressFnT
from pydantic import BaseModel, ConfigDict

from mcp import MCPError
from stopline.domain.model import CancelState
from stopline.domain.vocab import Cause, NoteKind
from stopline.integrations.mcp._task_state import RESULT_DATA, TaskIdParams
from stopline.integrations.mcp._task_wire import LEGACY, MODERN, Era, TaskView, parse_task
from stopline.integrations.mcp._vocab import OUTCOME_DATA, REJECTED_CODE, TASKS_EXTENSION
from stopline.runtime.context import CallContext
from stopline.runtime.provider_asks import CancelAnswer
from stopline.runtime.tool import NoAnswer

__all__ = [
    "CURRENT_CALL",
    "TASK_CANCEL",
    "Raw",
    "TaskCancel",
    "TaskOutcome",
    "TaskRequest",
    "TasksClient",
    "offers_legacy_tasks",
    "raw_request",
]

CURRENT_CALL: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar(
    "stopline_mcp_call", default=None
)
"""The gated call a ``tools/call`` belongs to (set by the client wrapper around the call)."""

FinalFn = Callable[[CallContext, "TaskOutcome"], Awaitable[None]]

TASK_CANCEL = "tasks/cancel"
"""The channel a task call's cancel takes, as the record names it."""


class TaskCancel:
    """One task call's ``tasks/cancel``: whether its call sent one, and the answer: an
    error (``CancelState.ERROR``), or an acknowledgement (2026; a 2025 status,
    ``cancelled`` or not: ``CancelState.ACKNOWLEDGED``), neither saying anything of
    the work; no answer is no answer (``None``: asked)."""

    def __init__(self) -> None:
        self.sent = False
        self.answer: CancelAnswer | None = None
        self.settled = anyio.Event()  # the call no longer follows its task: sent or never

    async def answered(self) -> CancelAnswer | None:
        """Once the call's following of the task ended: its ``tasks/cancel``'s answer."""
        await self.settled.wait()
        return self.answer


class CreatedTask(types.Result):
    """The 2026 claimed ``tools/call`` answer: ``Result & Task``, flat."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    result_type: Literal["task"] = "task"


class TaskRequest(types.Request[TaskIdParams, str]):
    """``tasks/get``, ``tasks/cancel``, ``tasks/result``: over HTTP, Mcp-Name is the task id."""

    name_param = "taskId"


class Raw(BaseModel):
    """Any result, kept whole (each era's task shapes are read by ``parse_task``)."""

    model_config = ConfigDict(extra="allow")


class TaskOutcome:
    """A task's final state (or its disappearance), and what it proves."""

    def __init__(self, view: TaskView | None, detail: str, result: Any = None) -> None:
        self.view = view
        self.detail = detail
        self.result = result  # a CallToolResult dict, when the work produced one

    @property
    def ref(self) -> str:
        return f"task:{self.view.task_id}" if self.view is not None else ""

    @property
    def proves(self) -> Literal["committed", "not_committed", "unknown"]:
        view = self.view
        if view is None:
            return "unknown"  # vanished or expired: nobody knows
        if view.outcome in ("committed", "not_committed"):
            return view.outcome  # type: ignore[return-value]  # a stopline server's own record
        if view.status == "completed" and self.result and not self.result.get("isError"):
            return "committed"
        return "unknown"  # cancelled, failed or isError without proof


def offers_legacy_tasks(capabilities: types.ServerCapabilities, tool: types.Tool) -> bool:
    """2025-11-25: may ``tool`` be called with ``params.task`` on this server?"""
    tasks = capabilities.tasks
    can_call = tasks is not None and tasks.requests is not None and tasks.requests.tools is not None
    support = tool.execution.task_support if tool.execution is not None else None
    return bool(can_call) and support in ("optional", "required")


class TasksClient(ClientExtension):
    """The client half; ``StoplineMCP(..., tasks=True)`` installs it."""

    identifier = TASKS_EXTENSION

    def __init__(
        self,
        *,
        spawn: Callable[..., None],
        on_final: FinalFn,
        follow_timeout: float = 300.0,
        min_poll: float = 0.01,
        max_poll: float = 5.0,
    ) -> None:
        self._spawn = spawn  # start a background task (the connection's task group)
        self._on_final = on_final
        self.follow_timeout = follow_timeout  # how long a cancelled task is followed
        self.min_poll, self.max_poll = min_poll, max_poll
        # each task call's tasks/cancel, by operation id and attempt (kept after the call:
        # its ask may come after, as a cut's does)
        self._cancels: collections.OrderedDict[tuple[str, int], TaskCancel]
        self._cancels = collections.OrderedDict()

    def cancel_of(self, call: CallContext) -> TaskCancel | None:
        """The ``tasks/cancel`` of ``call``'s task, if its request became one."""
        return self._cancels.get((call.op_id, call.attempt))

    def _task_call(self, call: CallContext | None) -> TaskCancel:
        """A call whose request became a task: from here its cancel goes by
        ``tasks/cancel`` (the same ask, which a cut sends too), and is kept."""
        cancel = TaskCancel()
        if call is not None:
            if call.canceller is not None:
                call.cancel_via(TASK_CANCEL, call.canceller[1], on_cut=bool(call.cut_sends))
            self._cancels[call.op_id, call.attempt] = cancel
            while len(self._cancels) > 4096:
                self._cancels.popitem(last=False)
        return cancel

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreatedTask, resolve=self._resolve)]

    async def _resolve(self, created: CreatedTask, cctx: ClaimContext) -> types.CallToolResult:
        view = _created(created.model_dump(by_alias=True, exclude_none=True))
        return await self.drive(cctx.session, view, MODERN)

    async def call_legacy(
        self,
        session: ClientSession,
        name: str,
        arguments: Mapping[str, Any],
        meta: Mapping[str, Any],
        on_progress: ProgressFnT | None,
        ttl_ms: int | None = None,
    ) -> types.CallToolResult:
        """2025-11-25: ``tools/call`` with ``params.task``, then the task to its end."""
        params = {
            "name": name,
            "arguments": dict(arguments),
            "task": {"ttl": ttl_ms} if ttl_ms else {},
            "_meta": dict(meta),
        }
        raw = await raw_request(session, "tools/call", params, on_progress)
        if not isinstance(raw.get("task"), Mapping):
            return types.CallToolResult.model_validate(raw)  # the server ran it inline
        return await self.drive(session, _created(raw), LEGACY)

    # -- one task, from creation to its end ---------------------------------------------------
    async def drive(self, session: ClientSession, view: TaskView, era: Era) -> types.CallToolResult:
        call = CURRENT_CALL.get()
        cancel = self._task_call(call)
        try:
            return await self._drive(session, view, era, call, cancel)
        finally:
            cancel.settled.set()

    async def _drive(
        self,
        session: ClientSession,
        view: TaskView,
        era: Era,
        call: CallContext | None,
        cancel: TaskCancel,
    ) -> types.CallToolResult:
        try:
            # the task exists from here on: a cancel that lands while its acceptance is
            # being recorded must still reach it (tasks/cancel), and it is still followed
            if call is not None:
                await call.accepted(ref=f"task:{view.task_id}", detail="the server created a task")
            final = await self._until_terminal(session, view, era)
        except MCPError as exc:  # not found / expired: nobody knows its outcome
            if exc.code == types.CONNECTION_CLOSED:
                raise  # the connection's end, not the task's: the call says so (``_call``)
            raise NoAnswer(
                Cause.SERVER_ERROR, f"task {view.task_id} vanished: {exc.message}"
            ) from exc
        except ValueError as exc:  # the server's answer to tasks/get was no task
            raise NoAnswer(Cause.SERVER_ERROR, f"task {view.task_id}: {exc}") from exc
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await self._ask_cancel(session, view.task_id, era, call, cancel)
            if call is not None:
                self._spawn(self._follow, session, view, era, call)
            raise
        return await self._answer(session, final, era)

    async def _until_terminal(self, session: ClientSession, view: TaskView, era: Era) -> TaskView:
        while not view.terminal:
            if view.expired(time.time()):
                raise NoAnswer(
                    Cause.SERVER_ERROR,
                    f"task {view.task_id} passed its TTL ({view.ttl_ms} ms) still {view.status}",
                )
            await anyio.sleep(self._interval(view))
            view = await self._get(session, view.task_id)
        return view

    async def _get(self, session: ClientSession, task_id: str) -> TaskView:
        """``tasks/get`` of ``task_id``; an answer for another task says nothing of this
        one (``ValueError``), nor does its state or result."""
        view = parse_task(await self._send(session, "tasks/get", task_id))
        if view.task_id != task_id:
            raise ValueError(f"tasks/get of {task_id} answered for task {view.task_id!r}")
        return view

    def _interval(self, view: TaskView) -> float:
        asked = (view.poll_interval_ms or 0) / 1000
        return min(max(asked, self.min_poll), self.max_poll)

    async def _answer(
        self, session: ClientSession, final: TaskView, era: Era
    ) -> types.CallToolResult:
        """A terminal task as the ``tools/call`` answer it stands for; see ``McpCall``."""
        if final.status == "completed":
            if era == LEGACY:
                return types.CallToolResult.model_validate(
                    await self._send(session, "tasks/result", final.task_id)
                )
            if final.result is not None:
                result = types.CallToolResult.model_validate(final.result)
                if result.is_error and final.outcome == "not_committed":
                    raise _refused(f"task {final.task_id}: tool error, nothing committed")
                return result
        if final.outcome == "not_committed":
            raise _refused(f"task {final.task_id} ended {final.status} before any effect")
        if final.status == "failed":
            error = final.error or {}
            if era == LEGACY:
                await self._send(session, "tasks/result", final.task_id)  # raises the task's error
            raise MCPError(
                code=int(error.get("code", types.INTERNAL_ERROR)),
                message=str(error.get("message", f"task {final.task_id} failed")),
                data=error.get("data"),
            )
        raise NoAnswer(
            Cause.SERVER_ERROR,
            f"task {final.task_id} ended {final.status}; the server does not prove what happened",
        )

    # -- cancel: a request, then the truth --------------------------------------------------
    async def _ask_cancel(
        self,
        session: ClientSession,
        task_id: str,
        era: Era,
        call: CallContext | None,
        cancel: TaskCancel,
    ) -> None:
        cancel.sent = True
        try:
            raw = await self._send(session, TASK_CANCEL, task_id)
            detail = (
                "acknowledged; cancellation is eventually consistent"
                if era == MODERN
                else f"status {raw.get('status')}; that alone proves nothing about the work"
            )
            # an answer, saying nothing of the work (ADR 0083, amendment): not "no answer"
            said = f"{TASK_CANCEL} of task {task_id}: {detail}"
            cancel.answer = CancelAnswer(CancelState.ACKNOWLEDGED, said)
        except MCPError as exc:
            if exc.code == types.CONNECTION_CLOSED:  # no answer: the connection ended
                detail = f"no answer: {exc.message}"
            else:  # the provider's answer, an error: it proves nothing of the work (R14)
                detail = f"answered with an error: MCP error {exc.code}: {exc.message}"
                said = f"{TASK_CANCEL} of task {task_id}: MCP error {exc.code}: {exc.message}"
                cancel.answer = CancelAnswer(CancelState.ERROR, said)
        if call is not None:  # a request, not an outcome
            await call.core.backend.note(
                call.op_id, NoteKind.TASK_CANCEL_REQUESTED, {"task_id": task_id, "detail": detail}
            )

    async def _follow(
        self, session: ClientSession, view: TaskView, era: Era, call: CallContext
    ) -> None:
        """After a cancel: poll until the task says what the work did, then report it."""
        outcome = TaskOutcome(view, f"task {view.task_id} still {view.status} after following")
        with anyio.move_on_after(self.follow_timeout):
            try:
                while True:
                    view = await self._get(session, view.task_id)
                    settled = view.terminal and (
                        era == MODERN or view.status != "cancelled" or view.outcome is not None
                    )
                    if settled:
                        outcome = await self._final(session, view, era)
                        break
                    await anyio.sleep(self._interval(view))
            except MCPError as exc:
                gone = "the connection ended" if exc.code == types.CONNECTION_CLOSED else "vanished"
                outcome = TaskOutcome(None, f"task {view.task_id} {gone}: {exc.message}")
            except ValueError as exc:  # an answer that is no task proves nothing
                outcome = TaskOutcome(None, f"task {view.task_id}: {exc}")
        await self._on_final(call, outcome)

    async def _final(self, session: ClientSession, view: TaskView, era: Era) -> TaskOutcome:
        detail = f"task {view.task_id} ended {view.status}" + (
            f" (server record: {view.outcome})" if view.outcome else ""
        )
        if era == MODERN or view.status == "failed":
            return TaskOutcome(view, detail, view.result)
        try:  # 2025: the payload lives behind tasks/result, even for a cancelled task
            return TaskOutcome(
                view, detail, await self._send(session, "tasks/result", view.task_id)
            )
        except MCPError as exc:
            data = exc.error.data if isinstance(exc.error.data, dict) else {}
            return TaskOutcome(view, detail, data.get(RESULT_DATA))

    async def _send(self, session: ClientSession, method: str, task_id: str) -> dict[str, Any]:
        request = TaskRequest(method=method, params=TaskIdParams(task_id=task_id))
        return (await session.send_request(request, Raw)).model_dump()


def _refused(message: str) -> MCPError:
    return MCPError(code=REJECTED_CODE, message=message, data={OUTCOME_DATA: "not_committed"})


async def raw_request(
    session: ClientSession,
    method: str,
    params: dict[str, Any],
    on_progress: ProgressFnT | None = None,
    headers: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A request whose answer the SDK's per-version result surface would reject.

    A 2025-11-25 ``tools/call`` with ``params.task`` answers ``{"task": ...}``,
    which the SDK validates as a ``CallToolResult`` and refuses. This goes one
    level down: the session's stamp (per-request ``_meta`` and headers) and its
    dispatcher, as ``send_request`` does, without the surface check. Cancelling
    the awaiting scope still sends the cancel. ``headers`` add HTTP headers.
    """
    data: dict[str, Any] = {"method": method, "params": params}
    opts: CallOptions = {}
    session._stamp(data, opts)
    if headers:
        opts.setdefault("headers", {}).update(headers)
    if on_progress is not None:
        opts["on_progress"] = on_progress
    return dict(await session._dispatcher.send_raw_request(method, data["params"], opts))


def _created(raw: Mapping[str, Any]) -> TaskView:
    """The task a ``tools/call`` answer says was created. One that cannot be read is the
    call's ``NoAnswer``: the work may be running, and nothing can follow it."""
    try:
        return parse_task(raw)
    except ValueError as exc:
        raise NoAnswer(Cause.SERVER_ERROR, f"the server's task cannot be read: {exc}") from exc
