"""Worker and canceller processes for the multi-process PostgreSQL tests.

Each worker opens the shared ledger, runs one keyed workflow against a
provider that keeps its own record of effects (a SQLite file per worker), and
talks to the test over a pipe: it reports markers and waits where told to.
Nothing here sleeps to synchronise; every wait is on the pipe or the ledger.

markers sent: ``S`` open, ``c<n>`` effect <n> committed at the provider,
``b<n>`` blocked inside call <n>, ``L`` its cancel listener lost its
connection, ``F`` the run ended, ``E:<error>`` the workflow raised.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from multiprocessing.connection import Connection
from pathlib import Path

import anyio
import anyio.to_thread

import stopline
from stopline import PhaseKind, Policy, VerifyBudget

BUDGET = VerifyBudget(attempts=2, first_delay=0.0)


@dataclasses.dataclass(frozen=True)
class Plan:
    url: str
    provider: str  # the provider's own record of effects
    run_id: str
    block_at: int | None = None  # call number that blocks until cancelled
    steps: int | None = None  # calls before finishing; None: until cancelled
    wait_each: bool = False  # wait for b"next" on the pipe before every call
    # after a listener drop: "go" waits for b"go" to reconnect, "forever" never does
    hold_listener: str | None = None
    policy: Policy = Policy.IMMEDIATE
    parent_run: str | None = None  # run the workflow as an exclusive child of this run


def effects(path: str) -> list[str]:
    if not Path(path).exists():
        return []
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS effects (key TEXT NOT NULL)")
        return [row[0] for row in conn.execute("SELECT key FROM effects ORDER BY rowid")]


def _commit_effect(path: str, key: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS effects (key TEXT NOT NULL)")
        conn.execute("INSERT INTO effects (key) VALUES (?)", (key,))
    finally:
        conn.close()


def make_tool(provider: str, on_block: object = None) -> stopline.Tool[int]:
    @stopline.tool(name="step")
    async def step(ctx: stopline.CallContext, n: int, block: bool = False) -> int:
        if block:
            await on_block(n)  # type: ignore[operator]
            await anyio.sleep_forever()  # until the cancel reaches this call
        _commit_effect(provider, ctx.key)
        return n

    @step.verifier
    async def _(ctx: stopline.CallContext) -> stopline.ReadBack:
        if ctx.key in effects(provider):
            return stopline.ReadBack(stopline.Verdict.COMMITTED, ctx.key, "found by key")
        return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, detail="no effect with this key")

    return step


async def _main(plan: Plan, pipe: Connection) -> None:
    async def send(marker: str) -> None:
        pipe.send_bytes(marker.encode())

    async def expect(word: bytes) -> None:
        got = await anyio.to_thread.run_sync(pipe.recv_bytes)
        assert got == word, f"expected {word!r}, got {got!r}"

    async def on_block(n: int) -> None:
        await send(f"b{n}")

    tool = make_tool(plan.provider, on_block)
    async with stopline.open(plan.url, verify=BUDGET, tools=[tool]) as ledger:
        listener = getattr(ledger.backend, "listener", None)
        if plan.hold_listener is not None and listener is not None:

            async def lost() -> None:
                await send("L")
                if plan.hold_listener == "go":
                    await expect(b"go")
                else:
                    await anyio.sleep_forever()  # the gate alone stands between us and R1

            listener.before_reconnect = lost
            await send(f"pid:{listener.pid}")  # its LISTEN connection, for the server to end
        await send("S")
        try:
            context = ledger.run(
                "job", owner="user:1", run_id=plan.run_id, parent_id=plan.parent_run
            )
            async with context as run, run.phase(PhaseKind.CALLING_EXTERNAL, plan.policy):
                n = 0
                while plan.steps is None or n < plan.steps:
                    if plan.wait_each:
                        await expect(b"next")
                    await run.call(tool, n, block=n == plan.block_at, key=f"k{n}")
                    if n < 10:  # the first few only: a loop must not fill the pipe
                        await send(f"c{n}")
                    n += 1
        except stopline.StoplineError as exc:
            await send(f"E:{type(exc).__name__}")
        await send("F")


def worker(plan: Plan, pipe: Connection) -> None:
    anyio.run(_main, plan, pipe)


async def _cancel(url: str, run_ids: list[str]) -> None:
    async with stopline.open(url) as ledger:
        for run_id in run_ids:
            await ledger.cancel(run_id, by="user:1", reason="stop from another process")


def canceller(url: str, run_ids: list[str]) -> None:
    """The fourth process: cancels and exits (like the CLI or the console)."""
    anyio.run(_cancel, url, run_ids)
