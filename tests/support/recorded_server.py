"""An MCP server whose tools return what tools return every day, kept by ``Effects``.

    python tests/support/recorded_server.py EFFECTS_DB        # stdio

Each tool with effects counts its commits in memory (``ctl_commits``, the
ground truth) and returns a value the standard library's ``json`` cannot write:

- ``stamp``: an async tool returning a dict with a ``datetime``;
- ``receipt``: an async tool returning a pydantic model;
- ``stamp_sync``: a plain ``def`` tool (``Effects.run_sync``) returning a dict
  with a ``datetime``;
- ``blob``: an async tool returning bytes that are not UTF-8, which have no JSON
  form at all (the SDK cannot answer with them either);
- ``long``: an async tool returning a string of ``size`` characters (longer than
  a record keeps, ``MAX_RESULT_CHARS``, when asked).

Called with ``fill=true``, an effect ends by setting this process's file size
limit to one byte: the effect has happened, and the record of its outcome
cannot be written (SQLite cannot grow its journal), the real fault of a disk
that filled during the commit, without root. ``ctl_free_disk`` lifts the limit.

``wait`` waits until its request is cancelled (``fill=true`` fills the disk
first); ``ctl_waits`` lists the requests waiting and those a cancel stopped.
"""

from __future__ import annotations

import datetime
import resource
import signal
import sys
from typing import Any

import anyio
import pydantic
from mcp.server.mcpserver import Context, MCPServer

from stopline.integrations.mcp import EFFECTS_META, Effects, effect_meta

__all__ = ["Receipt", "build"]

AT = datetime.datetime(2026, 12, 6, 9, 30, tzinfo=datetime.UTC)


class Receipt(pydantic.BaseModel):
    at: datetime.datetime
    commit: int


def limit_files(limit: int | None) -> None:
    """Writes past ``limit`` bytes fail with EFBIG (``None`` lifts the limit); from any
    thread (``SIGXFSZ`` is ignored at start, on the main thread)."""
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if limit is None else limit, hard))


def build(path: str) -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer("recorded")
    effects = Effects(path)
    effects.install(server)
    commits: list[str] = []
    waiting: list[str] = []  # requests of ``wait`` inside its wait
    stopped: list[str] = []  # requests of ``wait`` that a cancel stopped

    def effect(tool: str, fill: bool) -> int:
        commits.append(tool)
        if fill:
            limit_files(1)
        return len(commits)

    @server.tool(meta=effect_meta())
    async def stamp(ctx: Context[Any], fill: bool = False) -> dict[str, Any]:
        async with effects.operation(ctx, "stamp") as op:
            if op.replayed:
                replayed: dict[str, Any] = op.result
                return replayed
            return await op.commit(lambda: {"at": AT, "commit": effect("stamp", fill)})

    @server.tool(meta=effect_meta())
    async def receipt(ctx: Context[Any]) -> Receipt:
        async with effects.operation(ctx, "receipt") as op:
            if op.replayed:
                return Receipt.model_validate(op.result)
            return await op.commit(lambda: Receipt(at=AT, commit=effect("receipt", False)))

    @server.tool(meta=effect_meta())
    def stamp_sync(ctx: Context[Any], fill: bool = False) -> dict[str, Any]:
        commit = effects.run_sync
        return commit(ctx, "stamp_sync", lambda: {"at": AT, "commit": effect("stamp_sync", fill)})

    @server.tool(meta=effect_meta())
    async def blob(ctx: Context[Any]) -> Any:
        async with effects.operation(ctx, "blob") as op:
            if op.replayed:
                return op.result
            return await op.commit(lambda: [b"\xff", effect("blob", False)])

    @server.tool(meta=effect_meta())
    async def long(ctx: Context[Any], size: int) -> Any:
        async with effects.operation(ctx, "long") as op:
            if op.replayed:
                return op.result
            return await op.commit(lambda: "x" * size if effect("long", False) else "")

    @server.tool(meta=effect_meta())
    async def wait(ctx: Context[Any], fill: bool = False) -> None:
        async with effects.operation(ctx, "wait"):
            if fill:
                limit_files(1)
            waiting.append(str(ctx.request_id))
            try:
                await anyio.sleep_forever()
            finally:
                waiting.remove(str(ctx.request_id))
                stopped.append(str(ctx.request_id))

    @server.tool(meta={EFFECTS_META: False})
    def ctl_waits() -> dict[str, list[str]]:
        return {"waiting": list(waiting), "stopped": list(stopped)}

    @server.tool(meta={EFFECTS_META: False})
    def ctl_commits() -> list[str]:
        return list(commits)

    @server.tool(meta={EFFECTS_META: False})
    def ctl_free_disk() -> bool:
        limit_files(None)
        return True

    return server


if __name__ == "__main__":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    build(sys.argv[1]).run("stdio")
