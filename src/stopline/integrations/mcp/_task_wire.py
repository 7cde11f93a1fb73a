"""The two wire shapes of MCP tasks, written down once, for both ends.

Two eras that are not wire-compatible (docs/mcp.md, "Tasks"):

- who decides: 2025 the client (``params.task: {ttl?}``); 2026 the server, per
  request, when the client lists the extension in ``_meta[clientCapabilities]``;
- the ``tools/call`` answer: 2025 ``{"task": Task}`` (nested); 2026
  ``{"resultType": "task", ...Task}`` (flat);
- the Task's timing fields: 2025 ``ttl``, ``pollInterval``; 2026 ``ttlMs``,
  ``pollIntervalMs``;
- ``tasks/get``: 2025 ``Result & Task``; 2026 ``Result & DetailedTask`` (with
  ``result``, ``error`` or ``inputRequests`` by status);
- ``tasks/result`` (blocks until terminal, answers the payload) and
  ``tasks/list`` (paginated): 2025 only; 2026 answers -32601;
- ``tasks/cancel``: 2025 ``Result & Task``, already ``cancelled``; 2026 an empty
  acknowledgement; ``tasks/update`` (``inputResponses``, empty ack): 2026 only.

stopline adds one thing to both: ``_meta["io.stopline/outcome"]`` on a task
(``committed``, ``not_committed`` or ``unknown``), set by a stopline server
from its durable ``Effects`` record once the work really ended. A task's
``cancelled`` alone never proves that nothing happened.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Mapping
from typing import Any, Literal

from stopline.integrations.mcp._vocab import OUTCOME_DATA

__all__ = [
    "LEGACY",
    "MODERN",
    "RELATED_TASK_META",
    "TERMINAL",
    "Era",
    "TaskStatus",
    "TaskView",
    "iso",
    "millis",
    "parse_task",
]

Era = Literal["2025-11-25", "2026-07-28"]
LEGACY: Era = "2025-11-25"
MODERN: Era = "2026-07-28"

TaskStatus = Literal["working", "input_required", "completed", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"completed", "failed", "cancelled"})

RELATED_TASK_META = "io.modelcontextprotocol/related-task"
"""2025-11-25: ``_meta`` key tying a ``tasks/result`` payload to its task (``{taskId}``)."""


def iso(at: float) -> str:
    """An ISO 8601 UTC timestamp (the spec's ``createdAt`` / ``lastUpdatedAt``)."""
    return dt.datetime.fromtimestamp(at, dt.UTC).isoformat().replace("+00:00", "Z")


def _seconds(stamp: Any) -> float | None:
    if not isinstance(stamp, str):
        return None
    try:
        return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError):
        return None


def millis(value: Any) -> int | None:
    """A duration in ms as a server wrote it: a finite number, else none given (a
    server may write ``1e400``, which parses as infinity, or ``true``)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value)


@dataclasses.dataclass(frozen=True, slots=True)
class TaskView:
    """A task as one answer showed it (either era), as the client reads it."""

    task_id: str
    status: str
    created_at: float | None = None
    ttl_ms: int | None = None
    poll_interval_ms: int | None = None
    status_message: str | None = None
    result: dict[str, Any] | None = None  # 2026 tasks/get: the CallToolResult of a completed task
    error: dict[str, Any] | None = None  # 2026 tasks/get: the JSON-RPC error of a failed task
    input_requests: dict[str, Any] | None = None
    outcome: str | None = None  # _meta["io.stopline/outcome"], when a stopline server proves one

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def expired(self, now: float) -> bool:
        """The client's TTL backstop: ``createdAt + ttlMs`` has passed."""
        if self.ttl_ms is None or self.created_at is None:
            return False
        return now > self.created_at + self.ttl_ms / 1000


def parse_task(raw: Mapping[str, Any]) -> TaskView:
    """Read a task from any of the shapes above: nested or flat, either era's field names.

    Raises ``ValueError`` naming what is missing when it is no task at all.
    """
    body: Mapping[str, Any] = raw["task"] if isinstance(raw.get("task"), Mapping) else raw
    task_id, status = body.get("taskId"), body.get("status")
    if not isinstance(task_id, str) or not task_id or not isinstance(status, str):
        raise ValueError(f"not a task (taskId and status are required): {dict(raw)!r}")
    ttl = body.get("ttlMs", body.get("ttl"))
    poll = body.get("pollIntervalMs", body.get("pollInterval"))
    meta = raw.get("_meta") if isinstance(raw.get("_meta"), Mapping) else {}
    outcome = meta.get(OUTCOME_DATA) if meta else None
    result, error = body.get("result"), body.get("error")
    inputs = body.get("inputRequests")
    message = body.get("statusMessage")
    return TaskView(
        task_id=task_id,
        status=status,
        created_at=_seconds(body.get("createdAt")),
        ttl_ms=millis(ttl),
        poll_interval_ms=millis(poll),
        status_message=message if isinstance(message, str) else None,
        result=dict(result) if isinstance(result, Mapping) else None,
        error=dict(error) if isinstance(error, Mapping) else None,
        input_requests=dict(inputs) if isinstance(inputs, Mapping) else None,
        outcome=outcome if isinstance(outcome, str) else None,
    )
