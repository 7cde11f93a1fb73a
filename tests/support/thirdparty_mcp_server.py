"""A third-party-style MCP server for tests: it knows nothing of stopline.

It imports only the ``mcp`` SDK and the standard library, reads no
``io.stopline/*`` metadata and offers no ``stopline_verify``: it is what an
agent meets in the field. Use it to check what a client (stopline's, or the
bare SDK's) can prove against such a server.

Run it::

    python tests/support/thirdparty_mcp_server.py --log truth.jsonl            # stdio
    python tests/support/thirdparty_mcp_server.py --log truth.jsonl --fd 5     # HTTP on fd 5
    python tests/support/thirdparty_mcp_server.py --log truth.jsonl --http 8123

or from a test: ``stdio_params(log)`` and ``async with http_server(log) as url``.
Both protocol eras are served on both transports (the client chooses).

``--stopline-effects PATH`` builds the same tools the way stopline's
server-side helpers advise (tests/support/stopline_keeper.py: each effect
recorded by key in PATH, ``stopline_verify`` offered, each tool's ``_meta``
saying how it cancels), for the matrix's stopline read-back column. Without
it, nothing in the process knows of stopline.

**Ground truth.** ``--log`` is an append-only JSON-lines file the server
writes (and fsyncs) as things really happen, whichever process or transport:
``{"event": "commit" | "stopped" | "cancel_ignored", "tool", "key", "amount",
"at", "t", "pid"}``. ``commits(log)`` reads the effects back; the client never
has to be trusted about them.

**Tools with effects** (arguments ``idempotency_key: str, amount: int``; a
second call with a committed key returns the first result and commits
nothing):

============================  ===============================================
``pay_cancellable``           async; stops cleanly on a cancel (logs
                              ``stopped`` with the point it reached)
``pay_uncancellable``         async; once received, the charge finishes
                              whatever happens to the request (its answer
                              is dropped if the request was cancelled)
``pay_sync``                  a plain ``def`` tool: runs in a thread, cannot
                              be interrupted, its answer is dropped if the
                              request was cancelled
``pay_late``                  ignores ``notifications/cancelled`` (logs
                              ``cancel_ignored``) and answers anyway: a late
                              answer (on 2026 Streamable HTTP a cancel closes
                              the stream, so there it commits unanswered)
============================  ===============================================

**The read tool** ``find_payment(idempotency_key)`` answers ``{"found":
bool, "payment": {...} | None}`` from the ground-truth log: a found/not-found
read-back a client may map to a verifier.

**Progress points.** Every call passes the points 25, 50, 75 and 95 (percent
of the call), reporting a progress notification at each, then commits, then
passes ``done`` before answering. A test holds a point with the control
tools (``readOnlyHint``; names start with ``ctl_``):

- ``ctl_hold(tool, at, idempotency_key="")``: the next call of ``tool`` (with
  that key, when one is given) reaching ``at`` stops there;
- ``ctl_reached(tool, at, idempotency_key="")``: waits until one is held
  there, returns its key;
- ``ctl_release(tool, at, idempotency_key="")``: lets it go on;
- ``ctl_ended(key)``: waits until the call with that key ended here
  (``commit``, ``stopped``) and says how.

A held cancellable call stops at its point when the cancel arrives; the
others go on once released. Barriers, never sleeps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import JSONRPCNotification, JSONRPCRequest, ToolAnnotations

from mcp import MCPError, StdioServerParameters

__all__ = [
    "EFFECT_TOOLS",
    "POINTS",
    "READ_TOOL",
    "build_server",
    "commits",
    "http_server",
    "log_entries",
    "main",
    "stdio_params",
]

POINTS = ("25", "50", "75", "95")  # percent of the call; then the commit, then "done"
EFFECT_TOOLS = ("pay_cancellable", "pay_uncancellable", "pay_sync", "pay_late")
READ_TOOL = "find_payment"
_HERE = Path(__file__).resolve()
_READ = ToolAnnotations(read_only_hint=True)


# -- the ground truth ---------------------------------------------------------------
def log_entries(log: str | Path) -> list[dict[str, Any]]:
    """Every line the server wrote to its ground-truth log, in order. A line still being
    appended (another server process of the same log writing it as this one reads: a
    truth-matrix run failed ``ctl_ended`` with a ``JSONDecodeError`` so, under load) is
    not a line yet: only those ending with a newline are read."""
    path = Path(log)
    if not path.exists():
        return []
    lines = path.read_text().splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n") and line.strip()]


def commits(log: str | Path, key: str | None = None) -> list[dict[str, Any]]:
    """The effects that really happened (for one idempotency key, or all)."""
    return [
        e for e in log_entries(log) if e["event"] == "commit" and (key is None or e["key"] == key)
    ]


class _Log:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.ended: dict[str, anyio.Event] = {}

    def write(self, event: str, tool: str, key: str, **more: Any) -> None:
        line = {"event": event, "tool": tool, "key": key, "t": time.time(), "pid": os.getpid()}
        line.update(more)
        data = (json.dumps(line, sort_keys=True) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)

    def committed(self, key: str) -> dict[str, Any] | None:
        found = commits(self.path, key)
        return found[0] if found else None


# -- barriers -----------------------------------------------------------------------
class _Hold:
    def __init__(self) -> None:
        self.reached = anyio.Event()
        self.released = anyio.Event()
        self.thread_gate = threading.Event()  # a plain def tool blocks on this one
        self.key = ""

    def release(self) -> None:
        self.released.set()
        self.thread_gate.set()


class _Holds:
    """One-shot holds by (tool, point, key): the first call to reach it stops there.
    An empty key holds whichever call of the tool comes first."""

    def __init__(self) -> None:
        self.holds: dict[tuple[str, str, str], _Hold] = {}

    def hold(self, tool: str, at: str, key: str) -> _Hold:
        hold = self.holds[(tool, at, key)] = _Hold()
        return hold

    def take(self, tool: str, at: str, key: str) -> _Hold | None:
        for wanted in (key, ""):
            hold = self.holds.get((tool, at, wanted))
            if hold is not None and not hold.reached.is_set():
                hold.key = key
                hold.reached.set()
                return hold
        return None


# -- the server -----------------------------------------------------------------------
def build_server(
    log_path: str, *, dedupe: bool = True, keeper: Any = None
) -> tuple[MCPServer[Any], set[str]]:
    """The server, and the names of tools whose cancels it ignores (for the stream filter).

    ``dedupe=False`` (``--no-dedupe``): a server that is not idempotent by key, every
    call commits again. ``keeper`` (``--stopline-effects``, a
    ``tests.support.stopline_keeper.Keeper``): the same tools kept through stopline's
    server-side helpers, with ``stopline_verify``; without it nothing here knows of
    stopline.
    """
    log = _Log(log_path)
    holds = _Holds()
    server: MCPServer[Any] = MCPServer("thirdparty-payments")
    if keeper is not None:
        keeper.install(server)

    def meta(shielded: bool) -> dict[str, Any] | None:
        return None if keeper is None else dict(keeper.meta(shielded))

    def ended(key: str) -> anyio.Event:
        return log.ended.setdefault(key, anyio.Event())

    async def point(ctx: Context[Any] | None, tool: str, key: str, at: str) -> None:
        if ctx is not None and at in POINTS:
            # a closed stream stops no payment (a send to it may fail or block: bounded)
            with contextlib.suppress(Exception), anyio.move_on_after(1.0):
                await ctx.report_progress(float(at), 100.0, f"{tool} {at}%")
        hold = holds.take(tool, at, key)
        if hold is not None:
            await hold.released.wait()

    def commit(tool: str, key: str, amount: int) -> dict[str, Any]:
        existing = log.committed(key) if dedupe else None
        if existing is not None:
            return {"payment_id": key, "amount": existing["amount"], "replayed": True}
        log.write("commit", tool, key, amount=amount)
        return {"payment_id": key, "amount": amount, "replayed": False}

    async def pay(
        ctx: Context[Any] | None, tool: str, key: str, amount: int, keep: Any = None
    ) -> dict[str, Any]:
        """The call's points, then the commit (through ``keep``, the keeper's, if any)."""
        reached = "received"
        try:
            for at in POINTS:
                reached = at
                await point(ctx, tool, key, at)
            if keep is None:
                result = commit(tool, key, amount)
            else:
                result = await keep(lambda: commit(tool, key, amount))
            ended(key).set()
            reached = "done"
            await point(ctx, tool, key, "done")
            return result
        except anyio.get_cancelled_exc_class():
            if reached != "done":
                log.write("stopped", tool, key, at=reached)
                ended(key).set()
            raise

    def require(key: str) -> None:
        if not key:
            raise MCPError(code=-32602, message="idempotency_key must not be empty")

    async def kept(
        ctx: Context[Any], tool: str, key: str, amount: int, *, shielded: bool
    ) -> dict[str, Any]:
        if keeper is None:
            return await pay(ctx, tool, key, amount)

        async def body(keep: Any) -> dict[str, Any]:
            return await pay(ctx, tool, key, amount, keep)

        result: dict[str, Any] = await keeper.keep(ctx, tool, body, shielded=shielded)
        return result

    @server.tool(title="charge a card (stops on cancel)", meta=meta(False))
    async def pay_cancellable(
        idempotency_key: str, amount: int, ctx: Context[Any]
    ) -> dict[str, Any]:
        """Charge ``amount``; a cancel before the charge stops it."""
        require(idempotency_key)
        return await kept(ctx, "pay_cancellable", idempotency_key, amount, shielded=False)

    @server.tool(title="charge a card (cannot be stopped once received)", meta=meta(True))
    async def pay_uncancellable(
        idempotency_key: str, amount: int, ctx: Context[Any]
    ) -> dict[str, Any]:
        """Charge ``amount``; the charge finishes whatever happens to the request."""
        require(idempotency_key)
        with anyio.CancelScope(shield=True):  # a cancel is seen only once it has committed
            result = await kept(ctx, "pay_uncancellable", idempotency_key, amount, shielded=True)
        return result

    @server.tool(title="charge a card (synchronous)", meta=meta(True))
    def pay_sync(idempotency_key: str, amount: int, ctx: Context[Any]) -> dict[str, Any]:
        """Charge ``amount`` in a plain function: it cannot be interrupted."""
        require(idempotency_key)
        tool = "pay_sync"

        def body() -> dict[str, Any]:
            for at in POINTS:
                hold = anyio.from_thread.run_sync(holds.take, tool, at, idempotency_key)
                if hold is not None:
                    hold.thread_gate.wait()
            return commit(tool, idempotency_key, amount)

        result = body() if keeper is None else keeper.keep_sync(ctx, tool, body)
        anyio.from_thread.run_sync(lambda: ended(idempotency_key).set())
        hold = anyio.from_thread.run_sync(holds.take, tool, "done", idempotency_key)
        if hold is not None:
            hold.thread_gate.wait()
        assert isinstance(result, dict)
        return result

    @server.tool(title="charge a card (answers even when cancelled)", meta=meta(True))
    async def pay_late(idempotency_key: str, amount: int, ctx: Context[Any]) -> dict[str, Any]:
        """Charge ``amount``; a cancel is ignored and the answer is sent anyway."""
        require(idempotency_key)
        with anyio.CancelScope(shield=True):  # a 2026 HTTP stream close cancels the handler
            result = await kept(ctx, "pay_late", idempotency_key, amount, shielded=True)
        return result

    @server.tool(annotations=_READ)
    async def find_payment(idempotency_key: str) -> dict[str, Any]:
        """Look a payment up by its idempotency key."""
        found = log.committed(idempotency_key)
        payment = None if found is None else {"payment_id": found["key"], "amount": found["amount"]}
        count = len(commits(log.path, idempotency_key))
        return {"found": found is not None, "payment": payment, "count": count}

    # -- control tools, for tests --------------------------------------------------------
    @server.tool(annotations=_READ)
    async def ctl_hold(tool: str, at: str, idempotency_key: str = "") -> str:
        """Hold the next call of ``tool`` (with that key, if given) that reaches ``at``."""
        holds.hold(tool, at, idempotency_key)
        return at

    @server.tool(annotations=_READ)
    async def ctl_reached(tool: str, at: str, idempotency_key: str = "") -> dict[str, str]:
        """Wait until a call of ``tool`` is held at ``at``; its idempotency key."""
        hold = holds.holds.get((tool, at, idempotency_key))
        if hold is None:
            raise MCPError(code=-32602, message=f"no hold on {tool} at {at}")
        await hold.reached.wait()
        return {"key": hold.key}

    @server.tool(annotations=_READ)
    async def ctl_release(tool: str, at: str, idempotency_key: str = "") -> str:
        hold = holds.holds.pop((tool, at, idempotency_key), None)
        if hold is not None:
            hold.release()
        return at

    @server.tool(annotations=_READ)
    async def ctl_ended(idempotency_key: str) -> dict[str, Any]:
        """Wait until the call with this key ended here; how it ended."""
        await ended(idempotency_key).wait()
        last = [e for e in log_entries(log.path) if e["key"] == idempotency_key]
        return {"event": last[-1]["event"] if last else "", "at": last[-1].get("at", "")}

    _install_cancel_filter(server, log, {"pay_late"})
    return server, {"pay_late"}


# -- a cancel the server ignores (like a server in the field that answers anyway) -----
class _IgnoreCancels:
    """A read stream that drops ``notifications/cancelled`` aimed at requests of the
    given tools (the spec lets a receiver ignore a cancel) and logs each one."""

    def __init__(self, inner: Any, log: _Log, tools: set[str]) -> None:
        self._inner = inner
        self._log = log
        self._tools = tools
        self._calls: dict[str, tuple[str, str]] = {}  # request id -> (tool, key)

    async def receive(self) -> Any:
        from mcp.shared.message import SessionMessage

        while True:
            item = await self._inner.receive()
            m = item.message if isinstance(item, SessionMessage) else None
            if isinstance(m, JSONRPCRequest) and m.method == "tools/call":
                params = m.params or {}
                name = str(params.get("name", ""))
                if name in self._tools:
                    key = str((params.get("arguments") or {}).get("idempotency_key", ""))
                    self._calls[str(m.id)] = (name, key)
            if isinstance(m, JSONRPCNotification) and m.method == "notifications/cancelled":
                call = self._calls.get(str((m.params or {}).get("requestId")))
                if call is not None:
                    self._log.write("cancel_ignored", call[0], call[1])
                    continue
            return item

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> _IgnoreCancels:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> _IgnoreCancels:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _install_cancel_filter(server: MCPServer[Any], log: _Log, tools: set[str]) -> None:
    """Wrap the inbound stream of every session: stdio (``run``) and HTTP (``serve_loop``)."""
    import mcp.server.streamable_http_manager as manager

    low = server._lowlevel_server
    run = low.run

    async def filtered_run(read: Any, write: Any, *args: Any, **kwargs: Any) -> None:
        await run(_IgnoreCancels(read, log, tools), write, *args, **kwargs)

    low.run = filtered_run  # type: ignore[method-assign,assignment]
    serve_loop: Callable[..., Any] = manager.serve_loop  # type: ignore[attr-defined]

    async def filtered_loop(app: Any, read: Any, write: Any, **kwargs: Any) -> None:
        await serve_loop(app, _IgnoreCancels(read, log, tools), write, **kwargs)

    manager.serve_loop = filtered_loop  # type: ignore[attr-defined,assignment]


# -- starting it from a test ---------------------------------------------------------------
def stdio_params(log: str | Path, *extra: str) -> StdioServerParameters:
    """Parameters that start this server over stdio (one process per connection)."""
    return StdioServerParameters(
        command=sys.executable,
        args=[str(_HERE), "--log", str(log), *extra],
        cwd=str(_HERE.parent),
    )


@contextlib.contextmanager
def http_server(log: str | Path, *extra: str) -> Iterator[str]:
    """This server over Streamable HTTP on 127.0.0.1, listening before it starts; its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, str(_HERE), "--log", str(log), "--fd", str(sock.fileno()), *extra],
        pass_fds=[sock.fileno()],
        stderr=subprocess.DEVNULL,
    )
    sock.close()
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()  # uvicorn waits for open streams: a held call may keep one open
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log", required=True, help="the ground-truth JSON-lines file")
    parser.add_argument("--http", type=int, metavar="PORT", help="Streamable HTTP on 127.0.0.1")
    parser.add_argument("--fd", type=int, help="Streamable HTTP on this listening socket")
    parser.add_argument("--no-dedupe", action="store_true", help="not idempotent by key")
    parser.add_argument(
        "--stopline-effects",
        metavar="PATH",
        help="keep the tools through stopline's server-side helpers (record in PATH)",
    )
    args = parser.parse_args(argv)
    keeper = None
    if args.stopline_effects:
        sys.path.insert(0, str(_HERE.parent.parent.parent))  # the repository: tests.support
        from tests.support.stopline_keeper import Keeper

        keeper = Keeper(args.stopline_effects)
    server, _ = build_server(args.log, dedupe=not args.no_dedupe, keeper=keeper)
    if args.http or args.fd is not None:
        import uvicorn

        app = server.streamable_http_app()
        if args.fd is not None:
            uvicorn.run(app, fd=args.fd, log_level="warning")
        else:
            uvicorn.run(app, host="127.0.0.1", port=args.http, log_level="warning")
    else:
        server.run("stdio")


if __name__ == "__main__":
    main(sys.argv[1:])
