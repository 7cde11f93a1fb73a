"""A real, fault-injecting MCP server for testing agents' cancellation (and the demo).

    python -m stopline.integrations.mcp.testing --db effects.db            # stdio
    python -m stopline.integrations.mcp.testing --db effects.db --ignore-cancel
    python -m stopline.integrations.mcp.testing --db effects.db --http 8123
    python -m stopline.integrations.mcp.testing --db effects.db --http 8123 --sse

Its providers keep ground truth like ``stopline.testing.FakeProvider``:

- ``upload``: can cancel until it accepts; ``notify``: can never cancel;
  ``deploy``: declares it can cancel after acceptance, then refuses;
  ``sync_commit``: a plain ``def`` tool (runs in a thread, uninterruptible);
  ``work``: reports progress steps before committing; ``lookup``: a read.
- ``echo`` and ``unrecorded`` have effects the ``Effects`` record does not hold
  (``unrecorded`` says so, ``tracked=False``; ``echo`` declares nothing more than
  ``io.stopline/effects``): ``stopline_verify`` answers ``unknown`` for their keys.
  ``misdeclared`` declares ``io.stopline/tracked`` and records nothing (a server's
  bug): once it has answered a call, the server tracks it no more (ADR 0063).
  ``unrecorded`` and ``misdeclared`` stop at ``received`` and ``committed``.
- Each effectful call stops at the barriers ``received``, ``accepted``,
  ``committed``, ``responding`` (``sync`` for ``sync_commit``) when a test
  holds ``"<point>:<tool>"`` through the control tools ``ctl_hold``,
  ``ctl_reached`` (waits until a call is there; returns its key) and
  ``ctl_release``: deterministic, no sleeps.
- ``ctl_fault(tool, fault)`` arms a one-shot fault for the tool's next call:
  ``reject`` (refuse before any effect), ``die`` / ``break`` / ``garbage``
  (after the commit: the process exits, the wire is closed, malformed lines
  are written), ``answer-32800`` / ``answer0`` (after the commit, answer with
  that error: with ``--ignore-cancel`` it is what a cancelled request gets),
  ``lose-create`` (a task call: the task is created, then the process exits
  before the ``CreateTaskResult`` is written).
- ``ctl_truth()`` returns what really happened: every request, every effect
  (durable, in the same SQLite file as the ``Effects`` record, so it survives
  a restart) and the server's cancellation log.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import threading
from typing import Any, cast

import anyio
from mcp.server.context import CallNext, ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import JSONRPCNotification, ToolAnnotations
from opentelemetry import trace

from mcp import MCPError
from stopline.domain.vocab import Cancellable
from stopline.integrations.mcp._vocab import EFFECTS_META
from stopline.integrations.mcp.server import Effects, effect_meta, key_of
from stopline.integrations.mcp.tasks import TasksServer
from stopline.runtime.tool import Rejected
from stopline.testing.barriers import Barrier, Barriers

__all__ = ["build_server", "main"]

_CONTROL = {EFFECTS_META: False}
_READ = ToolAnnotations(read_only_hint=True)


class _Truth:
    """The providers' ground truth, durable next to the Effects record."""

    def __init__(self, path: str) -> None:
        self.path = path
        with sqlite3.connect(path) as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS provider_effects (key TEXT, tool TEXT, payload TEXT)"
            )
        self.requests: list[str] = []

    def commit(self, key: str, tool: str, payload: str) -> dict[str, Any]:
        with sqlite3.connect(self.path) as db:
            db.execute("INSERT INTO provider_effects VALUES (?, ?, ?)", (key, tool, payload))
        return {"id": key, "tool": tool, "value": payload}

    def effects(self) -> list[dict[str, str]]:
        with sqlite3.connect(self.path) as db:
            rows = db.execute(
                "SELECT key, tool, payload FROM provider_effects ORDER BY rowid"
            ).fetchall()
        return [{"key": k, "tool": t, "value": p} for k, t, p in rows]


def build_server(db: str) -> tuple[MCPServer[Any], Effects, TasksServer]:
    effects = Effects(db)
    tasks = TasksServer(effects=effects, tools={"upload": "optional", "notify": "optional"})
    truth = _Truth(db)
    barriers = Barriers()
    faults: dict[str, str] = {}
    server: MCPServer[Any] = MCPServer(
        "stopline-testing", extensions=[tasks], lifespan=tasks.lifespan
    )
    effects.install(server)

    async def lose_create(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> Any:
        """Fault ``lose-create``: the task is created, then the process dies unanswered."""
        out = await call_next(ctx)
        name = (ctx.params or {}).get("name") if ctx.method == "tools/call" else None
        created = isinstance(out, dict) and ("task" in out or out.get("resultType") == "task")
        if created and faults.get(str(name)) == "lose-create":
            os._exit(3)
        return out

    server.middleware.append(lose_create)
    tasks.install(server)
    traces: list[dict[str, Any]] = []

    async def record_trace(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> Any:
        """What trace context each request brought (the SDK's server span is current)."""
        if ctx.request_id is not None and not _control_call(ctx):
            meta = cast(dict[str, Any], ctx.meta or {})
            span = trace.get_current_span().get_span_context()
            traces.append(
                {
                    "method": ctx.method,
                    "traceparent": meta.get("traceparent"),
                    "trace_id": format(span.trace_id, "032x") if span.is_valid else None,
                }
            )
        return await call_next(ctx)

    server.middleware.append(record_trace)

    async def hold(point: str, tool: str, key: str) -> None:
        await barriers.reach(f"{point}:{tool}", key)

    def after_commit_fault(tool: str) -> None:
        fault = faults.pop(tool, "")
        if fault == "die":
            os._exit(3)
        if fault in ("break", "garbage"):
            from mcp.server import stdio as _stdio  # the real wire is a private dup of fd 1

            wire = _stdio._claims[1].private_fd
            assert wire is not None
            if fault == "garbage":
                os.write(wire, b"this is not json\n")
                os.write(wire, b'{"jsonrpc": "2.0", "method": 5}\n')
                os.write(wire, b'{"jsonrpc": "2.0", "id": 99999, "result": {}}\n')
                return
            os.close(wire)
        if fault.startswith("answer"):
            faults[tool] = fault  # used after the responding barrier

    async def provide(
        ctx: Context[Any],
        tool: str,
        payload: str,
        cancellable: Cancellable,
        *,
        refuse: bool = False,
    ) -> dict[str, Any]:
        async with effects.operation(ctx, tool, cancellable) as op:
            if op.replayed:
                return dict(op.result)
            truth.requests.append(op.key)
            await hold("received", tool, op.key)
            if faults.get(tool) == "reject":
                del faults[tool]
                raise Rejected(f"{tool} refused the request")
            await op.accepted()
            if refuse:
                op.refuse_cancel()  # a provider that refuses every cancel from here on
            await hold("accepted", tool, op.key)
            result = await op.commit(truth.commit, op.key, tool, payload)
            await hold("committed", tool, op.key)
            after_commit_fault(tool)
            await hold("responding", tool, op.key)
            fault = faults.pop(tool, "")
            if fault.startswith("answer"):
                code = 0 if fault == "answer0" else -32800
                raise MCPError(code=code, message="Request cancelled")
            return result

    @server.tool(title="upload the report to storage", meta=effect_meta(Cancellable.UNTIL_ACCEPTED))
    async def upload(payload: str, ctx: Context[Any]) -> dict[str, Any]:
        """Upload: the provider can cancel until it accepts."""
        return await provide(ctx, "upload", payload, Cancellable.UNTIL_ACCEPTED)

    @server.tool(title="notify #finance of the report", meta=effect_meta(Cancellable.NEVER))
    async def notify(payload: str, ctx: Context[Any]) -> dict[str, Any]:
        """Notify: the provider cannot cancel once it has the request."""
        return await provide(ctx, "notify", payload, Cancellable.NEVER)

    @server.tool(title="deploy the release", meta=effect_meta(Cancellable.AFTER_ACCEPTED))
    async def deploy(payload: str, ctx: Context[Any]) -> dict[str, Any]:
        """Deploy: says it can cancel after acceptance, then refuses every cancel."""
        return await provide(ctx, "deploy", payload, Cancellable.AFTER_ACCEPTED, refuse=True)

    @server.tool(title="work in steps", meta=effect_meta(Cancellable.UNTIL_ACCEPTED))
    async def work(payload: str, steps: int, ctx: Context[Any]) -> dict[str, Any]:
        """Reports ``steps`` progress notifications, then commits."""
        async with effects.operation(ctx, "work") as op:
            if op.replayed:
                return dict(op.result)
            for i in range(steps):
                await ctx.report_progress(i + 1, steps, f"step {i + 1}/{steps}")
            return await op.commit(truth.commit, op.key, "work", payload)

    @server.tool(title="commit synchronously", meta=effect_meta(Cancellable.NEVER))
    def sync_commit(payload: str, ctx: Context[Any]) -> dict[str, Any]:
        """A plain def tool: it runs in a worker thread and cannot be interrupted."""
        key = key_of(ctx)

        def effect() -> dict[str, Any]:
            gate = anyio.from_thread.run_sync(arrive, "sync:sync_commit", key)
            gate.wait()  # a thread cannot await: it blocks until the test releases it
            return truth.commit(key, "sync_commit", payload)

        return effects.run_sync(ctx, "sync_commit", effect)

    @server.tool(meta={EFFECTS_META: True})
    async def echo(payload: str) -> dict[str, Any]:
        """An effect with no server-side bookkeeping (the benchmark's tool)."""
        return {"value": payload}

    async def unwrapped(ctx: Context[Any], tool: str, payload: str) -> dict[str, Any]:
        """An effect kept in the providers' truth only, not in the ``Effects`` record."""
        key = key_of(ctx)
        await hold("received", tool, key)
        result = truth.commit(key, tool, payload)
        await hold("committed", tool, key)
        return result

    untracked = effect_meta(Cancellable.UNTIL_ACCEPTED, tracked=False)

    @server.tool(title="an effect the server does not record", meta=untracked)
    async def unrecorded(payload: str, ctx: Context[Any]) -> dict[str, Any]:
        """Commits with no record in Effects, and declares so: its verify is unknown."""
        return await unwrapped(ctx, "unrecorded", payload)

    @server.tool(title="an effect declared tracked, not recorded", meta=effect_meta())
    async def misdeclared(payload: str, ctx: Context[Any]) -> dict[str, Any]:
        """Declares ``io.stopline/tracked`` but records nothing through Effects (a bug)."""
        return await unwrapped(ctx, "misdeclared", payload)

    @server.tool(annotations=_READ, meta=_CONTROL)  # a read, declared in stopline's words
    async def lookup(key: str) -> dict[str, Any]:
        """A read: what the providers hold for ``key``."""
        return {"effects": [e for e in truth.effects() if e["key"] == key]}

    holds: dict[str, Barrier] = {}
    thread_gates: dict[str, threading.Event] = {}

    def arrive(point: str, key: str) -> threading.Event:
        """A thread's barrier: mark ``point`` reached; the thread waits on the gate."""
        gate = threading.Event()
        barrier = holds.get(point)
        if barrier is None:
            gate.set()
        else:
            barrier.key = key
            barrier.reached.set()
            thread_gates[point] = gate
        return gate

    @server.tool(meta=_CONTROL)
    async def ctl_hold(point: str) -> str:
        """Hold the next call that reaches ``point`` (``"<barrier>:<tool>"``)."""
        holds[point] = barriers.hold(point)
        return point

    @server.tool(meta=_CONTROL)
    async def ctl_reached(point: str) -> dict[str, Any]:
        """Wait until a call is held at ``point``; its idempotency key."""
        barrier = holds.get(point)
        if barrier is None:
            raise MCPError(code=-32602, message=f"no hold on {point!r}")
        await barrier.reached.wait()
        return {"key": barrier.key}

    @server.tool(meta=_CONTROL)
    async def ctl_release(point: str) -> str:
        barrier = holds.pop(point, None)
        if barrier is not None:
            barrier.release()
        gate = thread_gates.pop(point, None)
        if gate is not None:
            gate.set()
        return point

    @server.tool(meta=_CONTROL)
    async def ctl_die() -> str:
        """The server process exits at once, whatever it was doing."""
        os._exit(3)

    @server.tool(meta=_CONTROL)
    async def ctl_fault(tool: str, fault: str) -> str:
        faults[tool] = fault
        return fault

    @server.tool(meta=_CONTROL)
    async def ctl_forget_tasks() -> int:
        n = len(tasks.tasks)
        for task_id in list(tasks.tasks):
            tasks.forget(task_id)
        return n

    @server.tool(meta=_CONTROL)
    async def ctl_traces() -> list[dict[str, Any]]:
        """Every request's trace context as this server saw it."""
        return traces

    @server.tool(meta=_CONTROL)
    async def ctl_truth() -> dict[str, Any]:
        return {
            "requests": truth.requests,
            "effects": truth.effects(),
            "cancellations": await effects.cancellations(),
        }

    return server, effects, tasks


def _control_call(ctx: ServerRequestContext[Any, Any]) -> bool:
    name = (ctx.params or {}).get("name") if ctx.method == "tools/call" else None
    return isinstance(name, str) and name.startswith("ctl_")


class _DropCancelled:
    """A read stream that drops inbound ``notifications/cancelled`` (the spec allows
    ignoring a cancel) and logs each one as a refused cancel."""

    def __init__(self, inner: Any, effects: Effects) -> None:
        self._inner = inner
        self._effects = effects

    async def receive(self) -> Any:
        from mcp.shared.message import SessionMessage

        while True:
            item = await self._inner.receive()
            m = item.message if isinstance(item, SessionMessage) else None
            if isinstance(m, JSONRPCNotification) and m.method == "notifications/cancelled":
                params = m.params or {}
                rid = str(params.get("requestId"))
                await self._effects.cancel_ignored(rid, str(params.get("reason") or ""))
                continue
            return item

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> _DropCancelled:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> _DropCancelled:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _serve_ignoring_cancel(server: MCPServer[Any], effects: Effects) -> None:
    from mcp.server.stdio import stdio_server

    low = server._lowlevel_server
    async with stdio_server() as (read, write):
        await low.run(_DropCancelled(read, effects), write, low.create_initialization_options())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stopline.integrations.mcp.testing")
    parser.add_argument("--db", default=os.environ.get("STOPLINE_MCP_DB", "stopline-mcp.db"))
    parser.add_argument("--ignore-cancel", action="store_true", help="stdio: drop every cancel")
    parser.add_argument("--http", type=int, metavar="PORT", help="Streamable HTTP on 127.0.0.1")
    parser.add_argument("--fd", type=int, help="Streamable HTTP on this listening socket")
    parser.add_argument("--sse", action="store_true", help="with --http/--fd: the SSE transport")
    args = parser.parse_args(argv)
    server, effects, _ = build_server(args.db)
    if args.http or args.fd is not None:
        import uvicorn

        app = server.sse_app() if args.sse else server.streamable_http_app()
        if args.fd is not None:  # a socket the parent bound and listens on: no start-up race
            uvicorn.run(app, fd=args.fd, log_level="warning")
        else:
            uvicorn.run(app, host="127.0.0.1", port=args.http, log_level="warning")
    elif args.ignore_cancel:
        anyio.run(_serve_ignoring_cancel, server, effects)
    else:
        server.run("stdio")


if __name__ == "__main__":
    main(sys.argv[1:])
