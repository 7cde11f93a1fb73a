"""The test's side of the recovery-from-outside scenarios: process A started, read at
its markers, killed or stopped there; the ledger a process B opens; the destination
counted. Nothing here reaches into stopline: B sees only what its public API says.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

import stopline
from stopline import OperationRecord, OpStatus, VerifyBudget
from stopline.errors import OperationInDoubt
from tests.faults.recovery_outside_agent import MODULE, Plan, make_tool

__all__ = [
    "GUARD",
    "KEYS",
    "ONE_LOOK",
    "ROOT",
    "Agent",
    "Fifo",
    "agent",
    "b_tool",
    "ledger_urls",
    "outside_sql",
    "plan_for",
    "reenter",
    "refuse_moves",
    "release",
    "until_status",
]

ROOT = Path(__file__).resolve().parents[2]
GUARD = 60.0  # a hang guard for each wait, never a timing: a loaded machine is slow
ONE_LOOK = VerifyBudget(attempts=1, first_delay=0.0)
KEYS = ("k1", "k2", "k3")


def plan_for(url: str, tmp: Path, run_id: str, **options: Any) -> Plan:
    """A's workflow: ``charge`` under ``KEYS``; the options apply to the call ``k2``."""
    destination = str(tmp / "destination.db")
    return Plan(url, destination, run_id, KEYS, held_keys=(f"{run_id}/k2",), **options)


def b_tool(plan: Plan) -> stopline.Tool[dict[str, Any]]:
    """B's declaration of the same tool: its body waits on nothing."""
    return make_tool(dataclasses.replace(plan, hold="", held_keys=()))


async def reenter(ledger: stopline.Ledger, plan: Plan) -> tuple[list[Any], OperationInDoubt | None]:
    """What B does with a run whose worker died: run its workflow again under the same
    keys. As a workflow would, it stops at the first error (one in doubt: returned)."""
    tool = b_tool(plan)
    answers: list[Any] = []
    try:
        async with ledger.run("agent", owner="user:1", run_id=plan.run_id) as run:
            for i, key in enumerate(plan.keys):
                answers.append(await run.call(tool, i, key=key))
    except OperationInDoubt as exc:
        return answers, exc
    return answers, None


class Agent:
    """Process A, read marker by marker (its stdout); its stderr kept for the report."""

    def __init__(self, process: anyio.abc.Process, stderr: Path) -> None:
        self.process = process
        self.stderr = stderr
        self.seen: list[str] = []
        self._buffer = b""

    @property
    def pid(self) -> int:
        return self.process.pid

    async def until(self, prefix: str) -> str:
        """The first marker (from here on) that starts with ``prefix``."""
        assert self.process.stdout is not None
        with anyio.fail_after(GUARD):
            while True:
                while b"\n" in self._buffer:
                    line, self._buffer = self._buffer.split(b"\n", 1)
                    text = line.decode()
                    self.seen.append(text)
                    if text.startswith(prefix):
                        return text
                try:
                    self._buffer += await self.process.stdout.receive()
                except anyio.EndOfStream:
                    raise AssertionError(
                        f"A ended before {prefix!r}; markers {self.seen};"
                        f" stderr: {self.stderr.read_text()[-3000:]}"
                    ) from None

    async def kill(self) -> None:
        """SIGKILL, wherever A is."""
        os.kill(self.pid, signal.SIGKILL)
        with anyio.fail_after(GUARD):
            await self.process.wait()

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    async def ended(self) -> int:
        with anyio.fail_after(GUARD):
            return await self.process.wait()


@contextlib.asynccontextmanager
async def agent(plan: Plan, tmp: Path, *, other_host: bool = False) -> AsyncIterator[Agent]:
    """Start process A on ``plan``; ``other_host``: in a UTS namespace of its own, so its
    worker records another host name (a worker B cannot see the process of)."""
    plan_file = tmp / f"plan-{plan.run_id}.json"
    plan.dump(plan_file)
    command = [sys.executable, "-m", MODULE, str(plan_file)]
    if other_host:
        command = ["unshare", "-u", "sh", "-c", 'hostname a-remote-host && exec "$0" "$@"']
        command += [sys.executable, "-m", MODULE, str(plan_file)]
    stderr = tmp / f"agent-{plan.run_id}.stderr"
    with stderr.open("wb") as err:
        process = await anyio.open_process(command, stdout=subprocess.PIPE, stderr=err, cwd=ROOT)
    try:
        yield Agent(process, stderr)
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)  # a stopped process is not killed else
                os.kill(process.pid, signal.SIGKILL)
            with anyio.fail_after(GUARD):
                await process.wait()
        await process.aclose()


class Fifo:
    """A barrier across processes: a reader of it waits until ``release`` is called."""

    def __init__(self, path: Path) -> None:
        self.path = path
        os.mkfifo(path)

    def released(self) -> bool:
        """Let the waiting reader go; False while none has opened it yet."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: no reader yet
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            return False
        os.close(fd)  # the reader reads end-of-file: it goes on
        return True


async def release(fifo: Fifo) -> None:
    """Until a reader of ``fifo`` (A's tool body, the provider's writer) is let go."""
    with anyio.fail_after(GUARD):
        while not fifo.released():  # noqa: ASYNC110 (another process's open, no event)
            await anyio.sleep(0.02)


async def until_status(
    ledger: stopline.Ledger, op_id: str, statuses: set[OpStatus], *, guard: float = GUARD
) -> OperationRecord:
    """The operation once its status is one of ``statuses`` (woken by each change)."""
    with anyio.fail_after(guard):
        while True:
            op = await ledger.backend.get_operation(op_id)
            if op.status in statuses:
                return op
            await ledger.wait_for_change(op.run_id, poll=0.05)


def outside_sql(url: str, *statements: str) -> None:
    """Statements run on the ledger's own database by another client (an operator)."""
    if url.startswith("sqlite:///"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///").split("?", 1)[0])
        try:
            for statement in statements:
                conn.execute(statement)
            conn.commit()
        finally:
            conn.close()
        return
    import psycopg

    base, _, schema = url.partition("?schema=")
    with psycopg.connect(base, autocommit=True, options=f"-c search_path={schema}") as pg:
        for statement in statements:
            pg.execute(statement)


def refuse_moves(url: str, op_id: str, source: str, target: str) -> None:
    """From outside, the ledger's database refuses for ever to move ``op_id`` from
    ``source`` to ``target`` (a trigger: a constraint an operator or a migration set)."""
    when = f"OLD.id = '{op_id}' AND OLD.status = '{source}' AND NEW.status = '{target}'"
    if url.startswith("sqlite:///"):
        outside_sql(
            url,
            f"CREATE TRIGGER refuse_{source}_{target} BEFORE UPDATE ON operations WHEN {when}"
            " BEGIN SELECT RAISE(ABORT, 'refused by a trigger'); END",
        )
        return
    outside_sql(
        url,
        "CREATE OR REPLACE FUNCTION refuse_move() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN RAISE EXCEPTION 'refused by a trigger'; END $$",
        f"CREATE TRIGGER refuse_{source}_{target} BEFORE UPDATE ON operations FOR EACH ROW"
        f" WHEN ({when}) EXECUTE FUNCTION refuse_move()",
    )


def _postgres() -> Iterator[str]:
    from tests.postgres.server import fresh_schema

    yield from fresh_schema()


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_urls(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The ledger A and B share: a real SQLite file, or a schema on the real PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    yield from _postgres()
