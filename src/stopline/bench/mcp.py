"""MCP figure: what a gated tool call costs over the bare SDK client.

Both calls go to the same stdio server process (the testing server's
``echo`` tool, which does no bookkeeping of its own), over the same
connection, alternating one gated and one bare call so that drift on a noisy
machine hits both sides alike. The gated call adds the dispatch gate's
durable intent, the outcome record and the idempotency key in ``_meta``.
The floor it is held to, one bare durable transaction, is measured in the
same alternation (gated, bare, bare transaction): measured apart, after the
server process had gone quiet, it came out at about half of what the same
transaction costs beside a live stdio server on two cores.

The same alternation also asks the server's ``stopline_verify`` about a key of
``echo`` (a tool whose calls the record does not hold, so the answer rests on the
server's tool listing as well as its record): what a client's read-back costs,
against the bare call.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import stopline
from stopline.bench.core import bare_txn
from stopline.bench.figures import Figure, median, percentile

__all__ = ["measure"]


async def measure(*, quick: bool, workdir: Path, postgres: str | None = None) -> list[Figure]:
    from mcp import StdioServerParameters
    from stopline.integrations.mcp import VERIFY_TOOL, StoplineMCP

    n = 150 if quick else 1000
    args = ["-m", "stopline.integrations.mcp.testing", "--db", str(workdir / "mcp-server.db")]
    server = StdioServerParameters(command=sys.executable, args=args)
    gated: list[float] = []
    bare: list[float] = []
    txns: list[float] = []
    verifies: list[float] = []
    url = f"sqlite:///{workdir / 'mcp-bench.db'}"
    async with (
        stopline.open(url) as ledger,
        StoplineMCP(server, mode="legacy", name="bench") as mcp,
        ledger.run("bench-mcp", owner="bench") as run,
        bare_txn(workdir / "mcp-bare.db") as txn_once,
    ):
        for i in range(n + 10):  # the first ten warm every path up
            start = time.perf_counter()
            await mcp.call(run, "echo", {"payload": "x"})
            middle = time.perf_counter()
            await mcp.client.call_tool("echo", {"payload": "x"})
            end = time.perf_counter()
            txn_s = await txn_once()
            asked = time.perf_counter()
            await mcp.client.call_tool(VERIFY_TOOL, {"key": f"bench-{i}", "tool": "echo"})
            answered = time.perf_counter()
            if i >= 10:
                gated.append((middle - start) * 1e6)
                bare.append((end - middle) * 1e6)
                txns.append(txn_s * 1e6)
                verifies.append((answered - asked) * 1e6)
    # what the gate adds to one call, against the floor any durable gate pays: one bare
    # durable transaction through a writer like ours, in the same alternation
    added = median([g - b for g, b in zip(gated, bare, strict=True)])
    txn = median(txns)
    return [
        Figure(
            "mcp_call_overhead_ratio",
            percentile(gated, 50),
            "us",
            baseline=percentile(bare, 50),
            note=f"p50 of {n} gated vs {n} bare stdio tools/call, alternating, one server",
        ),
        Figure(
            "mcp_call_overhead_us",
            added,
            "us",
            baseline=txn,
            target="ratio <= 1.3",
            note="median of (gated - bare) over the alternating pairs vs one bare durable "
            "fence-check+insert txn through a writer thread, measured in the same alternation",
        ),
        Figure(
            "mcp_verify_us",
            percentile(verifies, 50),
            "us",
            baseline=percentile(bare, 50),
            note=f"p50 of {n} stdio stopline_verify round trips (a key of an untracked tool) "
            "vs the bare tools/call, in the same alternation",
        ),
    ]
