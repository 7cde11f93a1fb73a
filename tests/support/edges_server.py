"""An MCP server whose tracked tools fail, stall and die where the record cannot see.

    python tests/support/edges_server.py --db EFFECTS_DB            # stdio
    python tests/support/edges_server.py --db EFFECTS_DB --fd N     # Streamable HTTP

Every tool below declares ``io.stopline/tracked`` (``effect_meta()``), and each keeps
its own ground truth (``provider_effects`` in the same SQLite file, durable across a
restart) apart from the ``Effects`` record:

- ``pay(amount)``: honest; records through ``effects.operation`` and commits.
- ``precheck(amount)``: honest; refuses an amount over 100 with a ``ToolError``
  before it records anything (no effect), else commits like ``pay``.
- ``leaky(payload, fail)``: a server's bug: makes its effect *before* recording
  anything, then raises (``fail``) or answers (not ``fail``).
- ``stall(payload)``: holds at ``body:stall`` before it records anything (a test
  holds it there), then records and commits like ``pay``.
- ``hurried(payload, seconds)``: honest, its work bounded by its own deadline
  (``anyio.fail_after(seconds)``); 0 runs out as its record begins.

``leaky`` and ``pay`` also stop at ``body:<tool>`` when a test holds that point (through
``ctl_hold``, ``ctl_reached``, ``ctl_release``). ``ctl_redeclare(tool, tracked)``
declares a tool again (and says so: ``notifications/tools/list_changed``);
``ctl_listings`` counts how often ``list_tools`` ran; ``ctl_fill_disk(fill)`` fills the
disk (writes past one byte fail) or frees it; ``ctl_die`` ends the process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
from collections.abc import Callable
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import Tool as McpTool

from stopline.integrations.mcp import EFFECTS_META, Effects, effect_meta, key_of
from stopline.testing.barriers import Barrier, Barriers
from tests.support.recorded_server import limit_files

__all__ = ["build"]

_CONTROL = {EFFECTS_META: False}


def build(path: str) -> tuple[MCPServer[Any], Effects]:
    server: MCPServer[Any] = MCPServer("edges")
    listings = [0]
    list_tools = server.list_tools

    async def counted() -> list[McpTool]:
        listings[0] += 1
        return await list_tools()

    server.list_tools = counted  # type: ignore[method-assign]  # the test's own probe
    effects = Effects(path)
    effects.install(server)
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE IF NOT EXISTS provider_effects (key TEXT, tool TEXT)")
    barriers = Barriers()
    holds: dict[str, Barrier] = {}

    def effect(key: str, tool: str) -> dict[str, Any]:
        with sqlite3.connect(path) as db:
            db.execute("INSERT INTO provider_effects VALUES (?, ?)", (key, tool))
        return {"id": key, "tool": tool}

    async def recorded(ctx: Context[Any], tool: str) -> dict[str, Any]:
        async with effects.operation(ctx, tool) as op:
            if op.replayed:
                return dict(op.result)
            return await op.commit(effect, op.key, tool)

    @server.tool(meta=effect_meta())
    async def pay(amount: int, ctx: Context[Any]) -> dict[str, Any]:
        """Honest: every call recorded."""
        await barriers.reach("body:pay", key_of(ctx))
        return await recorded(ctx, "pay")

    @server.tool(meta=effect_meta())
    async def precheck(amount: int, ctx: Context[Any]) -> dict[str, Any]:
        """Honest: refuses a large amount before recording, with no effect."""
        if amount > 100:
            raise ToolError(f"{amount} is over the limit")
        return await recorded(ctx, "precheck")

    @server.tool(meta=effect_meta())
    async def leaky(
        payload: str, ctx: Context[Any], fail: bool = True, fill: bool = False
    ) -> dict[str, Any]:
        """A bug: the effect is made before anything is recorded (``fill``: then the
        disk fills)."""
        key = key_of(ctx)
        done = effect(key, "leaky")
        if fill:
            limit_files(1)
        await barriers.reach("body:leaky", key)
        if fail:
            raise RuntimeError("leaky broke after its effect")
        return done

    @server.tool(meta=effect_meta())
    async def stall(payload: str, ctx: Context[Any]) -> dict[str, Any]:
        """Honest, but waits before it records anything."""
        await barriers.reach("body:stall", key_of(ctx))
        return await recorded(ctx, "stall")

    @server.tool(meta=effect_meta())
    async def hurried(payload: str, seconds: float, ctx: Context[Any]) -> dict[str, Any]:
        """Honest, with a deadline of its own around its recorded work."""
        with anyio.fail_after(seconds):
            return await recorded(ctx, "hurried")

    @server.tool(meta=_CONTROL)
    async def ctl_hold(point: str) -> str:
        holds[point] = barriers.hold(point)
        return point

    @server.tool(meta=_CONTROL)
    async def ctl_reached(point: str) -> str:
        await holds[point].reached.wait()
        return str(holds[point].key)

    @server.tool(meta=_CONTROL)
    async def ctl_release(point: str) -> str:
        holds.pop(point).release()
        return point

    @server.tool(meta=_CONTROL)
    async def ctl_redeclare(tool: str, tracked: bool, ctx: Context[Any]) -> str:
        tools: dict[str, Callable[..., Any]] = {
            "pay": pay,
            "precheck": precheck,
            "leaky": leaky,
            "stall": stall,
        }
        fn = tools[tool]
        server.remove_tool(tool)
        server.add_tool(fn, name=tool, meta=effect_meta(tracked=tracked))
        if ctx.request_context.protocol_version == "2026-07-28":
            await ctx.notify_tools_changed()
        else:
            await ctx.session.send_tool_list_changed()
        return tool

    @server.tool(meta=_CONTROL)
    async def ctl_listings() -> int:
        return listings[0]

    @server.tool(meta=_CONTROL)
    async def ctl_truth() -> list[dict[str, str]]:
        with sqlite3.connect(path) as db:
            rows = db.execute("SELECT key, tool FROM provider_effects ORDER BY rowid").fetchall()
        return [{"key": k, "tool": t} for k, t in rows]

    @server.tool(meta=_CONTROL)
    def ctl_fill_disk(fill: bool) -> bool:
        """The disk is full (writes past one byte fail) or has room again."""
        limit_files(1 if fill else None)
        return fill

    @server.tool(meta=_CONTROL)
    async def ctl_die() -> str:
        os._exit(3)

    return server, effects


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--fd", type=int)
    options = parser.parse_args()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a full disk fails the write, not the process
    server, _ = build(options.db)
    if options.fd is not None:
        import uvicorn

        uvicorn.run(server.streamable_http_app(), fd=options.fd, log_level="warning")
    else:
        server.run("stdio")


if __name__ == "__main__":
    main()
