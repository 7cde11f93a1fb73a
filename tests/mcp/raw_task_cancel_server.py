"""A tasks server written straight on JSON-RPC, with no SDK and nothing of stopline: its
``tasks/cancel`` is answered with a JSON-RPC error, as a server we never saw may.

    python tests/mcp/raw_task_cancel_server.py ERA ERROR LOG [--fd FD]

``ERA`` is ``2025-11-25`` (the client asks for a task with ``params.task``; nested
``CreateTaskResult``; ``tasks/result``) or ``2026-07-28`` (the server makes every
``upload`` a task; flat ``resultType: "task"``; ``tasks/get`` carries the result).
Served over stdio, or over Streamable HTTP (plain JSON answers; every POST one
message) on the listening socket ``FD`` this process inherits.

Its one tool, ``upload``, offers tasks and knows nothing of stopline: no
``io.stopline/*`` metadata, no ``stopline_verify``. A call creates task ``t-<n>``,
``working`` until a ``tasks/cancel`` for it arrives. That cancel is answered with
the error ``ERROR`` names: ``terminal`` (-32602, the work finished just before the
cancel came: the spec's answer for a terminal task) or ``internal`` (-32603, the
server failed to cancel; the work then finishes anyway). Either way the task is
``completed`` from then on, its work done: what a client learns only by reading
the task again.

``LOG`` is the ground truth, one JSON object a line, written as things happen:
``{"event": "created" | "cancel" | "effect" | "get", "task": id}``; a ``get`` is
logged only after the task's cancel came.
"""

from __future__ import annotations

import datetime as dt
import http.server
import json
import socket
import sys
import threading
from typing import Any

__all__ = ["ERRORS", "Tasks", "main"]

ERRORS = {
    "terminal": (-32602, "task {task} is already completed: it cannot be cancelled"),
    "internal": (-32603, "the task store failed while cancelling {task}"),
}


class Tasks:
    """The server's state and its answers, one JSON-RPC message at a time (under a lock:
    the HTTP server answers each POST in a thread of its own)."""

    def __init__(self, era: str, error: str, log: str) -> None:
        self.era, self.error, self.log = era, error, log
        self.modern = era == "2026-07-28"
        self.created = 0
        self.done: set[str] = set()  # the tasks a cancel came for: their work is done
        self.lock = threading.Lock()

    def _log(self, event: str, task: str) -> None:
        with open(self.log, "a") as f:
            f.write(json.dumps({"event": event, "task": task}) + "\n")

    def _task(self, task_id: str) -> dict[str, Any]:
        now = dt.datetime.now(dt.UTC).isoformat()
        status = "completed" if task_id in self.done else "working"
        task: dict[str, Any] = {"taskId": task_id, "status": status}
        task |= {"createdAt": now, "lastUpdatedAt": now}
        if self.modern:
            return task | {"ttlMs": 60_000, "pollIntervalMs": 10}
        return task | {"ttl": 60_000, "pollInterval": 10}

    def _result(self, task_id: str) -> dict[str, Any]:
        return {"content": [{"type": "text", "text": f"uploaded by {task_id}"}], "isError": False}

    def answer(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """The answer to ``message``; ``None`` for a notification."""
        with self.lock:
            method, rid = message.get("method"), message.get("id")
            if rid is None:
                return None
            try:
                result = self._answer(str(method), message.get("params") or {})
            except LookupError as exc:
                code, text = exc.args
                return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": text}}
            if self.modern:
                result = {"resultType": "complete", **result}
            return {"jsonrpc": "2.0", "id": rid, "result": result}

    def _answer(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        if method == "initialize":
            tasks: dict[str, Any] = {"requests": {"tools": {"call": {}}}, "cancel": {}}
            return {
                "protocolVersion": self.era,
                "capabilities": {"tools": {}, "tasks": tasks},
                "serverInfo": {"name": "raw-task-cancel", "version": "0"},
            }
        if method == "tools/list":
            upload = {"name": "upload", "inputSchema": {"type": "object"}}
            listed = {"tools": [upload | {"execution": {"taskSupport": "optional"}}]}
            return listed | ({"ttlMs": 0, "cacheScope": "private"} if self.modern else {})
        if method == "tools/call":
            self.created += 1
            task_id = f"t-{self.created}"
            self._log("created", task_id)
            if self.modern:
                return {"resultType": "task", **self._task(task_id)}
            return {"task": self._task(task_id)}
        task_id = str(params.get("taskId"))
        if method == "tasks/cancel":
            self._log("cancel", task_id)
            self.done.add(task_id)
            self._log("effect", task_id)  # the work finishes: before or despite the cancel
            code, text = ERRORS[self.error]
            raise LookupError(code, text.format(task=task_id))
        if method == "tasks/get":
            if task_id in self.done:
                self._log("get", task_id)
            task = self._task(task_id)
            if self.modern and task_id in self.done:
                task["result"] = self._result(task_id)
            return task
        if method == "tasks/result" and task_id in self.done:
            return self._result(task_id)
        raise LookupError(-32601, f"no method {method}")


def _stdio(tasks: Tasks) -> None:
    for line in sys.stdin:
        answer = tasks.answer(json.loads(line))
        if answer is not None:
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()


def _http(tasks: Tasks, fd: int) -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            answer = tasks.answer(json.loads(body))
            if answer is None:
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # no stream of the server's own messages
            self.send_response(405)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_DELETE = do_GET  # no session to end

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = socket.socket(fileno=fd)
    server.daemon_threads = True
    server.serve_forever()


def main(argv: list[str]) -> None:
    era, error, log = argv[:3]
    tasks = Tasks(era, error, log)
    if argv[3:4] == ["--fd"]:
        _http(tasks, int(argv[4]))
    else:
        _stdio(tasks)


if __name__ == "__main__":
    main(sys.argv[1:])
