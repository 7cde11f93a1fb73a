"""A 2025-11-25 tasks server written straight on JSON-RPC, with no SDK: it answers as
a server we never saw may, with numbers and shapes no careful server sends.

    python tests/support/odd_tasks_server.py MODE

Its one tool, ``upload``, offers tasks (``execution.taskSupport: optional``) and
says it has effects; ``lookup`` is a read answered at once. A ``tools/call`` of
``upload`` creates task ``t-<n>`` and holds it ``working``; what the server then
answers depends on ``MODE``:

- ``huge-ttl``: the task's ``ttl`` and ``pollInterval`` are ``1e400``, a JSON
  number no float holds (infinity once parsed); ``tasks/get`` completes it.
- ``not-a-task``: ``tasks/get`` answers ``{}``, which is no task.
- ``no-task-id``: the created task has no ``taskId``.
- ``not-a-task-after-cancel``: ``tasks/get`` answers the task ``working`` until
  a ``tasks/cancel`` arrives, then ``{}``.

``send`` has effects and no tasks: its answer waits for the client's
``notifications/cancelled`` and then comes late, as ``{"content": 5}``.

In the ``not-a-task`` modes a ``lookup`` is answered only once a ``tasks/get``
has been answered ``{}``: a read of another run in flight across that answer.
``ctl_pending`` (a read) says how many lookups and sends wait. ``tasks/cancel`` answers
the task ``cancelled``; ``tasks/result`` a text result.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from typing import Any

__all__ = ["main"]

PROTOCOL = "2025-11-25"


def _answer(rid: Any, result: dict[str, Any]) -> None:
    text = json.dumps({"jsonrpc": "2.0", "id": rid, "result": result})
    sys.stdout.write(text.replace('"<huge>"', "1e400") + "\n")
    sys.stdout.flush()


def _found(pending: list[Any]) -> None:
    while pending:
        _answer(pending.pop(0), {"content": [{"type": "text", "text": "found"}]})


def _task(task_id: str, status: str, mode: str) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC).isoformat()
    task: dict[str, Any] = {"taskId": task_id, "status": status, "createdAt": now}
    task |= {"lastUpdatedAt": now, "ttl": 60_000, "pollInterval": 10}
    if mode == "huge-ttl":
        task |= {"ttl": "<huge>", "pollInterval": "<huge>"}
    return task


def main(mode: str) -> None:
    created, cancelled, answered_none = 0, False, False
    pending: list[Any] = []  # lookups not answered yet
    sends: list[Any] = []  # sends waiting for their cancel
    for line in sys.stdin:
        message = json.loads(line)
        method, rid = message.get("method"), message.get("id")
        params = message.get("params") or {}
        if method == "notifications/cancelled" and params.get("requestId") in sends:
            sends.remove(params["requestId"])
            _answer(params["requestId"], {"content": 5})  # late, and no list of blocks
        if rid is None:
            continue  # a notification
        if method == "initialize":
            tasks: dict[str, Any] = {"requests": {"tools": {"call": {}}}, "cancel": {}, "list": {}}
            _answer(
                rid,
                {
                    "protocolVersion": PROTOCOL,
                    "capabilities": {"tools": {}, "tasks": tasks},
                    "serverInfo": {"name": "odd-tasks", "version": "0"},
                },
            )
        elif method == "tools/list":
            effects = {"name": "upload", "inputSchema": {"type": "object"}}
            effects |= {"execution": {"taskSupport": "optional"}}
            reads = [
                {
                    "name": name,
                    "inputSchema": {"type": "object"},
                    "annotations": {"readOnlyHint": True},
                }
                for name in ("lookup", "ctl_pending")
            ]
            send = {"name": "send", "inputSchema": {"type": "object"}}
            _answer(rid, {"tools": [effects, send, *reads]})
        elif method == "tools/call" and params.get("name") == "ctl_pending":
            waiting = str(len(pending) + len(sends))
            _answer(rid, {"content": [{"type": "text", "text": waiting}]})
        elif method == "tools/call" and params.get("name") == "send":
            sends.append(rid)
        elif method == "tools/call" and params.get("name") == "lookup":
            pending.append(rid)
            if answered_none or not mode.startswith("not-a-task"):
                _found(pending)
        elif method == "tools/call":
            created += 1
            task = _task(f"t-{created}", "working", mode)
            if mode == "no-task-id":
                del task["taskId"]
            _answer(rid, {"task": task})
        elif method == "tasks/get":
            task_id = str(params.get("taskId"))
            if mode == "not-a-task" or (mode == "not-a-task-after-cancel" and cancelled):
                _answer(rid, {})
                answered_none = True
                _found(pending)
            elif mode == "not-a-task-after-cancel":
                _answer(rid, _task(task_id, "working", mode))
            else:
                _answer(rid, _task(task_id, "completed", mode))
        elif method == "tasks/cancel":
            cancelled = True
            _answer(rid, _task(str(params.get("taskId")), "cancelled", mode))
        elif method == "tasks/result":
            _answer(rid, {"content": [{"type": "text", "text": "done"}]})
        else:
            error = {"code": -32601, "message": f"no method {method}"}
            sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": rid, "error": error}) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
