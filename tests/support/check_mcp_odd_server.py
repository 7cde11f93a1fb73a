"""A server written with the ``mcp`` SDK alone, whose tools behave in the ways that
``stopline check-mcp`` must report as evidence only (tests/mcp/test_check_mcp_evidence.py).

Ground truth: each effect is one JSON line ``{"key": ...}`` appended to ``--log``.

- ``commit(key)``: commits and answers at once (an answer before any cancel can land).
- ``sleepy(key)``: sleeps until cancelled; commits nothing.
- ``progress_commit(key)``: a progress notification, then commits and answers.
- ``hang_on_repeat(key)``: commits and answers, except for check-mcp's repeat keys
  (``check-repeat-...``), which it never answers.
- ``find(key)``: how many effects the log holds for ``key`` (a read).
- with ``--unknown-verify``: a ``stopline_verify`` that answers ``unknown`` for every key.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

server: MCPServer[Any] = MCPServer("check-mcp-odd")
LOG = Path("effects.jsonl")


def _commit(key: str) -> None:
    with LOG.open("a") as f:
        f.write(json.dumps({"key": key}) + "\n")


def _count(key: str) -> int:
    if not LOG.exists():
        return 0
    return sum(1 for line in LOG.read_text().splitlines() if json.loads(line)["key"] == key)


@server.tool(meta={"io.stopline/effects": True, "io.stopline/cancellable": "after_accepted"})
async def commit(key: str) -> dict[str, Any]:
    _commit(key)
    return {"ok": True}


@server.tool()
async def sleepy(key: str) -> dict[str, Any]:
    await anyio.sleep_forever()
    return {"ok": False}


@server.tool()
async def progress_commit(key: str, ctx: Context) -> dict[str, Any]:
    await ctx.report_progress(1, 2, "working")
    _commit(key)
    return {"ok": True}


@server.tool()
async def hang_on_repeat(key: str) -> dict[str, Any]:
    if key.startswith("check-repeat-"):
        await anyio.sleep_forever()
    _commit(key)
    return {"ok": True}


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def find(key: str) -> dict[str, Any]:
    return {"count": _count(key)}


def _unknown_verify() -> None:
    @server.tool(name="stopline_verify", annotations=ToolAnnotations(read_only_hint=True))
    async def stopline_verify(key: str, wait_seconds: float = 0) -> dict[str, Any]:
        return {"key": key, "state": "unknown", "verdict": "unknown", "detail": "no record"}


def main() -> None:
    global LOG
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", required=True)
    parser.add_argument("--unknown-verify", action="store_true")
    parser.add_argument("--start-delay", type=float, default=0.0)  # npx's first run
    args = parser.parse_args()
    time.sleep(args.start_delay)
    LOG = Path(args.log)
    if args.unknown_verify:
        _unknown_verify()
    server.run("stdio")


if __name__ == "__main__":
    main()
