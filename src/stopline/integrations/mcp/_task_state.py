"""One task as the server holds it, and its answers in each era's shape.

Ask versus effect (STYLE 4): ``cancel_requested`` says a ``tasks/cancel``
arrived; ``status`` says what the protocol reports; ``outcome`` says what the
work really did, and is set only once the work ended.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import anyio
import mcp_types as types
from pydantic import Field

from mcp import MCPError
from stopline.integrations.mcp._task_wire import MODERN, RELATED_TASK_META, Era, iso
from stopline.integrations.mcp._vocab import OUTCOME_DATA

__all__ = ["CANCELLED_CODE", "RESULT_DATA", "ServerTask", "TaskIdParams", "UpdateParams"]

CANCELLED_CODE = -32800
"""2025-11-25 ``tasks/result`` of a cancelled task: a JSON-RPC error with this code."""

RESULT_DATA = "io.stopline/result"
"""In that error's ``data``: the ``CallToolResult`` the work produced after all, if it did."""


class TaskIdParams(types.RequestParams):
    task_id: str


class UpdateParams(TaskIdParams):
    input_responses: dict[str, Any] = Field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class ServerTask:
    task_id: str
    owner: str  # the principal that created it; nobody else may see it
    era: Era
    tool: str
    key: str | None  # the request's _meta["io.stopline/key"]
    created_at: float
    last_updated_at: float
    ttl_ms: int | None
    poll_interval_ms: int
    status: str = "working"
    status_message: str | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    outcome: str | None = None
    cancel_requested: bool = False
    scope: anyio.CancelScope = dataclasses.field(default_factory=anyio.CancelScope)
    ended: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    _change: anyio.Event = dataclasses.field(default_factory=anyio.Event)

    def expired(self, now: float) -> bool:
        return self.ttl_ms is not None and now > self.created_at + self.ttl_ms / 1000

    async def changed(self) -> None:
        await self._change.wait()

    def _mark(self) -> None:
        self.last_updated_at = time.time()
        change, self._change = self._change, anyio.Event()
        change.set()

    def cancel_legacy(self) -> None:
        """2025-11-25: ``cancelled`` before the answer; the work is asked to stop."""
        self.cancel_requested = True
        self.status = "cancelled"
        self.status_message = "cancelled at the client's request; see io.stopline/outcome"
        self.scope.cancel()
        self._mark()

    def finish(
        self,
        *,
        result: dict[str, Any] | None,
        error: dict[str, Any] | None,
        interrupted: bool,
        outcome: str | None,
    ) -> None:
        """The work ended: record how. A legacy ``cancelled`` stays ``cancelled``."""
        self.result, self.error, self.outcome = result, error, outcome
        if self.status != "cancelled":
            if interrupted:
                self.status, self.status_message = "cancelled", "the work was stopped"
            elif error is not None:
                self.status = "failed"
                self.status_message = str(error.get("message") or "the request failed")
            else:  # isError: true still counts as completed
                self.status = "completed"
        self.ended.set()
        self._mark()

    # -- shapes ---------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {OUTCOME_DATA: self.outcome} if self.outcome is not None else {}

    def fields(self) -> dict[str, Any]:
        modern = self.era == MODERN
        out: dict[str, Any] = {
            "taskId": self.task_id,
            "status": self.status,
            "createdAt": iso(self.created_at),
            "lastUpdatedAt": iso(self.last_updated_at),
            "ttlMs" if modern else "ttl": self.ttl_ms,
            "pollIntervalMs" if modern else "pollInterval": self.poll_interval_ms,
        }
        if self.status_message is not None:
            out["statusMessage"] = self.status_message
        return out

    def created(self) -> dict[str, Any]:
        """The ``tools/call`` answer: flat with ``resultType: "task"`` (2026), nested (2025)."""
        if self.era == MODERN:
            return {"resultType": "task", **self.fields()}
        return {"task": self.fields()}

    def detailed(self) -> dict[str, Any]:
        """2026 ``tasks/get``: ``Result & DetailedTask``."""
        out: dict[str, Any] = {"resultType": "complete", **self.fields()}
        if self.status == "completed" and self.result is not None:
            out["result"] = self.result
        elif self.status == "failed" and self.error is not None:
            out["error"] = self.error
        if self.meta():
            out["_meta"] = self.meta()
        return out

    def legacy(self) -> dict[str, Any]:
        """2025 ``tasks/get`` / ``tasks/cancel`` / a ``tasks/list`` entry: ``Result & Task``."""
        out = self.fields()
        if self.meta():
            out["_meta"] = self.meta()
        return out

    def payload(self) -> dict[str, Any]:
        """2025 ``tasks/result`` of a terminal task: what the request would have returned."""
        related = {RELATED_TASK_META: {"taskId": self.task_id}, **self.meta()}
        if self.status == "completed" and self.result is not None:
            meta = {**(self.result.get("_meta") or {}), **related}
            return {**self.result, "_meta": meta}
        if self.status == "cancelled":
            data: dict[str, Any] = {**related}
            if self.result is not None:
                data[RESULT_DATA] = self.result
            raise _error(CANCELLED_CODE, f"task {self.task_id} was cancelled", data)
        error = self.error or {"code": types.INTERNAL_ERROR, "message": "the task failed"}
        data = {**(error.get("data") or {}), **related}
        raise _error(int(error.get("code", types.INTERNAL_ERROR)), str(error.get("message")), data)


def _error(code: int, message: str, data: dict[str, Any]) -> Exception:
    return MCPError(code=code, message=message, data=data)
