"""The S17 worker: a process that runs one keyed workflow against a durable provider.

The parent (``test_s17_worker_killed_mid_operation``) starts one per kill
cycle, reads the markers it writes, and kills it with SIGKILL at a seeded
point. The provider keeps its own record of committed effects in its own
SQLite file, one row per effect, so an effect that happened twice shows.
"""

from __future__ import annotations

import dataclasses
import random
import sqlite3
from multiprocessing.connection import Connection
from pathlib import Path

import anyio

import stopline
from stopline import VerifyBudget

# markers: S started, R recovered and reconciled, then per operation
# g before the gate, a accepted, c committed at the provider, d recorded; F finished
BUDGET = VerifyBudget(attempts=1, first_delay=0.0)


@dataclasses.dataclass(frozen=True)
class Plan:
    ledger: str
    provider: str
    run_id: str
    ops: int
    seed: int
    pause_at: str | None  # "<op>:<marker>": write "!" there and wait to be killed


def provider_effects(path: str) -> list[str]:
    with sqlite3.connect(path) as conn:
        return [row[0] for row in conn.execute("SELECT key FROM effects ORDER BY rowid")]


def _commit_effect(path: str, key: str, value: int) -> None:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE IF NOT EXISTS effects (key TEXT NOT NULL, value INTEGER)")
        conn.execute("INSERT INTO effects (key, value) VALUES (?, ?)", (key, value))
    finally:
        conn.close()


def _has_effect(path: str, key: str) -> bool:
    if not Path(path).exists():
        return False
    conn = sqlite3.connect(path, timeout=30)
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS effects (key TEXT NOT NULL, value INTEGER)")
        return conn.execute("SELECT 1 FROM effects WHERE key = ?", (key,)).fetchone() is not None
    finally:
        conn.close()


def make_tool(plan: Plan, mark: object) -> stopline.Tool[int]:
    rng = random.Random(plan.seed)
    accept = {i: rng.random() < 0.5 for i in range(plan.ops)}

    @stopline.tool(name="charge")
    async def charge(ctx: stopline.CallContext, i: int) -> int:
        if accept[i]:
            await ctx.accepted(ref=f"psp:{ctx.key}")
            await mark(i, "a")  # type: ignore[operator]
        _commit_effect(plan.provider, ctx.key, i)  # the effect, durable at the provider
        await mark(i, "c")  # type: ignore[operator]
        return i

    @charge.verifier
    async def _(ctx: stopline.CallContext) -> stopline.ReadBack:
        # the sender of every operation in doubt is dead, so absent means never
        if _has_effect(plan.provider, ctx.key):
            return stopline.ReadBack(stopline.Verdict.COMMITTED, f"psp:{ctx.key}", "found by key")
        return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, detail="no effect with this key")

    return charge


async def _main(plan: Plan, out: Connection, go: Connection) -> None:
    async def mark(i: int, point: str) -> None:
        out.send_bytes(point.encode())
        if plan.pause_at == f"{i}:{point}":
            out.send_bytes(b"!")
            await anyio.sleep_forever()  # the parent kills us here

    tool = make_tool(plan, mark)
    async with stopline.open(plan.ledger, verify=BUDGET, tools=[tool]) as ledger:
        out.send_bytes(b"S")
        await ledger.reconcile(budget=BUDGET)
        out.send_bytes(b"R")
        go.recv_bytes()  # the parent checks the ledger, then lets us go on
        try:
            async with ledger.run("s17", owner="user:1", run_id=plan.run_id) as run:
                for i in range(plan.ops):
                    await mark(i, "g")
                    await run.call(tool, i, key=f"k{i}")
                    await mark(i, "d")
        except stopline.RunEnded:
            pass  # killed after its run completed, before it could say so: nothing left to do
        out.send_bytes(b"F")


def main(plan: Plan, out: Connection, go: Connection) -> None:
    anyio.run(_main, plan, out, go)
