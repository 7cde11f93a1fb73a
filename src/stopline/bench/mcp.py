"""MCP figure: what a gated tool call costs over the bare SDK client.

Both calls go to the same stdio server process (the testing server's
``echo`` tool, which does no bookkeeping of its own), over the same
connection, alternating one gated and one bare call so that drift on a noisy
machine hits both sides alike. The gated call adds the dispatch gate's
durable intent, the outcome record and the idempotency key in ``_meta``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import stopline
from stopline.bench.figures import Figure, percentile

__all__ = ["measure"]


async def measure(*, quick: bool, workdir: Path, postgres: str | None = None) -> list[Figure]:
    from mcp import StdioServerParameters
    from stopline.integrations.mcp import StoplineMCP

    n = 150 if quick else 1000
    args = ["-m", "stopline.integrations.mcp.testing", "--db", str(workdir / "mcp-server.db")]
    server = StdioServerParameters(command=sys.executable, args=args)
    gated: list[float] = []
    bare: list[float] = []
    url = f"sqlite:///{workdir / 'mcp-bench.db'}"
    async with (
        stopline.open(url) as ledger,
        StoplineMCP(server, mode="legacy", name="bench") as mcp,
        ledger.run("bench-mcp", owner="bench") as run,
    ):
        for i in range(n + 10):  # the first ten warm both paths up
            start = time.perf_counter()
            await mcp.call(run, "echo", {"payload": "x"})
            middle = time.perf_counter()
            await mcp.client.call_tool("echo", {"payload": "x"})
            end = time.perf_counter()
            if i >= 10:
                gated.append((middle - start) * 1e6)
                bare.append((end - middle) * 1e6)
    return [
        Figure(
            "mcp_call_overhead_ratio",
            percentile(gated, 50),
            "us",
            baseline=percentile(bare, 50),
            target="ratio <= 1.10",
            note=f"p50 of {n} gated vs {n} bare stdio tools/call, alternating, one server",
        )
    ]
