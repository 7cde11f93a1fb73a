"""A worker killed while its provider works on: ``python -m tests.rules.horizon_worker URL AT``.

Its tool states the provider's horizon (``await ctx.settles_by(AT)``: written before
it returns), says ``stated`` on stdout and waits for the kill (SIGKILL, from the test).
"""

from __future__ import annotations

import sys

import anyio

import stopline

HORIZON_TOOL = "transfer"


async def main(url: str, at: float) -> None:
    async def transfer(ctx: stopline.CallContext, amount: int) -> str:
        await ctx.settles_by(at)  # the provider: lands by then, or never
        print("stated", flush=True)
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async with stopline.open(url) as ledger, ledger.run("pay", owner="user:1", run_id="r") as run:
        await run.call(stopline.Tool(transfer, name=HORIZON_TOOL), 25, key="transfer")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], float(sys.argv[2]))
