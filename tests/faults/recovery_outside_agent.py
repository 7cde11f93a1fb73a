"""Process A of the recovery-from-outside tests: an agent whose tool writes a real
destination, run as its own process so the test can SIGKILL or SIGSTOP it.

``python -m tests.faults.recovery_outside_agent PLAN.json`` runs one workflow, a
call of ``charge`` per key, in the run ``plan.run_id``. The destination is a
SQLite file with one row per effect (``effects``) and per correction
(``refunds``): an effect that happened twice shows as two rows. The tool
declares a read-back by key and a correction, as a production tool would.

Barriers, never sleeps: A writes a marker line to stdout at each point
(``ready``, ``sent KEY`` once the tool body runs, i.e. past the gate,
``effect KEY`` once the destination holds it, ``answered KEY``, ``error KEY
TYPE``, ``done``), flushed. The calls ``plan.held_keys`` names wait on a FIFO
(``plan.hold``) before their effect: opening a FIFO for reading blocks until
the test opens it for writing, so the test decides when the effect lands. With
``plan.late`` the effect is made by a detached writer process (a provider that
finishes the request on its own, ``handed KEY`` once it runs) that waits on
that FIFO: it outlives A.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

import stopline
from stopline import ReadBack, Verdict
from stopline.runtime.tool import Compensation

__all__ = ["MODULE", "Plan", "corrections", "effects", "make_tool"]

MODULE = "tests.faults.recovery_outside_agent"  # run with -m, where __name__ is __main__


@dataclasses.dataclass(frozen=True)
class Plan:
    ledger: str
    destination: str
    run_id: str
    keys: tuple[str, ...]
    lease: float = 30.0
    held_keys: tuple[str, ...] = ()  # the calls (their op ids) the options below apply to
    hold: str = ""  # a FIFO a held call's body waits on before its effect ("": no wait)
    late: bool = False  # a held call's effect is made by a detached writer waiting on hold
    stop_after_effect: bool = False  # a held call waits for ever after its effect
    settles_within: float | None = None  # R13: the tool's declared horizon
    state_horizon: float | None = None  # R13: a held call states one, seconds from now
    accept: bool = False  # the provider acknowledges each request before its effect

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def load(cls, path: str) -> Plan:
        data = json.loads(Path(path).read_text())
        data["keys"] = tuple(data["keys"])
        data["held_keys"] = tuple(data["held_keys"])
        return cls(**data)


def _sql(path: str, statement: str, *params: object) -> list[tuple[Any, ...]]:
    """One statement on the destination, in a connection of its own (as its clients do)."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE IF NOT EXISTS effects (key TEXT NOT NULL, by_pid INTEGER)")
        conn.execute("CREATE TABLE IF NOT EXISTS refunds (key TEXT NOT NULL, original TEXT)")
        return conn.execute(statement, params).fetchall()
    finally:
        conn.close()


def effects(path: str) -> list[str]:
    """Every effect the destination holds, one entry per effect (a repeat shows twice)."""
    return [row[0] for row in _sql(path, "SELECT key FROM effects ORDER BY rowid")]


def corrections(path: str) -> list[str]:
    """The calls the destination refunded, one entry per refund."""
    return [row[0] for row in _sql(path, "SELECT original FROM refunds ORDER BY rowid")]


def write_effect(path: str, key: str) -> None:
    _sql(path, "INSERT INTO effects (key, by_pid) VALUES (?, ?)", key, os.getpid())


def _read_back(path: str, table: str, key: str, what: str) -> ReadBack:
    """The destination read by key: the rows there, or none (the writer of it is A)."""
    found = _sql(path, f"SELECT count(*) FROM {table} WHERE key = ?", key)[0][0]
    if found:
        return ReadBack(Verdict.COMMITTED, f"{table}:{key}", f"{found} row(s) by key")
    return ReadBack(Verdict.NOT_COMMITTED, detail=f"no {what} with this key")


def _wait_on(fifo: str) -> None:
    """Until the test opens the FIFO for writing and closes it (a barrier, no polling)."""
    with open(fifo, "rb") as held:
        held.read()


def make_tool(plan: Plan, mark: Any = None) -> stopline.Tool[dict[str, Any]]:
    """``charge``: one effect per call at the destination, read back by key, correctable."""

    def say(line: str) -> None:
        if mark is not None:
            mark(line)

    @stopline.tool(
        name="charge", compensation=Compensation.NEVER, settles_within=plan.settles_within
    )
    async def charge(ctx: stopline.CallContext, amount: int) -> dict[str, Any]:
        say(f"sent {ctx.key}")
        if plan.accept:
            await ctx.accepted(ref=f"psp:{ctx.key}")
        held = ctx.key in plan.held_keys
        if held and plan.state_horizon is not None:
            await ctx.settles_by(time.time() + plan.state_horizon)
        if held and plan.late:  # the provider finishes the request by itself, later
            writer = subprocess.Popen(  # noqa: ASYNC220  # started, then awaited in a thread
                [sys.executable, "-m", MODULE, "--writer", plan.destination, ctx.key, plan.hold],
                start_new_session=True,  # its own session: A's death does not reach it
            )
            say(f"handed {ctx.key}")
            await anyio.to_thread.run_sync(writer.wait)
        else:
            if held and plan.hold:
                await anyio.to_thread.run_sync(_wait_on, plan.hold)
            write_effect(plan.destination, ctx.key)
        say(f"effect {ctx.key}")
        if held and plan.stop_after_effect:
            await anyio.sleep_forever()  # the test kills A here: the answer is lost
        return {"charged": amount, "key": ctx.key}

    @charge.verifier
    async def _(ctx: stopline.CallContext) -> ReadBack:
        return _read_back(plan.destination, "effects", ctx.key, "effect")

    @charge.compensator
    async def _(ctx: stopline.CallContext) -> dict[str, Any]:
        original = getattr(ctx, "compensates", None)  # a correction's context names it
        _sql(
            plan.destination, "INSERT INTO refunds (key, original) VALUES (?, ?)", ctx.key, original
        )
        return {"refunded": original}

    @charge.compensation_verifier
    async def _(ctx: stopline.CallContext) -> ReadBack:
        return _read_back(plan.destination, "refunds", ctx.key, "refund")

    return charge


async def _main(plan: Plan) -> None:
    def mark(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    tool = make_tool(plan, mark)
    ledger = stopline.open(plan.ledger, tools=[tool])
    ledger.lease = plan.lease  # registered under it as it opens
    async with ledger:
        mark(f"ready {ledger.worker_id}")
        async with ledger.run("agent", owner="user:1", run_id=plan.run_id) as run:
            for i, key in enumerate(plan.keys):
                try:
                    await run.call(tool, i, key=key)
                except Exception as exc:
                    mark(f"error {key} {type(exc).__name__}")
                    continue
                mark(f"answered {key}")
    mark("done")


def _writer(destination: str, key: str, fifo: str) -> None:
    """The detached provider: the effect lands once the test releases it."""
    _wait_on(fifo)
    write_effect(destination, key)


if __name__ == "__main__":
    if sys.argv[1] == "--writer":
        _writer(*sys.argv[2:5])
    else:
        anyio.run(_main, Plan.load(sys.argv[1]))
