"""A row another session holds, on a real PostgreSQL: the run whose row it is waits, the
others go on (``stopline.ledger.postgres_aside``).

Another session holds an operation's or a run's row (an operator's ``SELECT ... FOR
UPDATE`` left open, a worker frozen mid-transaction). The group commit runs one
transaction at a time for the process: a write waiting for that row held every other
run's gates and outcomes behind it for a whole lock timeout (``retry_for``), twice,
and again at each retry, for as long as the row stayed held. Each test holds the row
for as long as the test needs (``retry_for`` is two minutes, so a wait for it would
not end within the test's guard) and releases it at the end: nothing is lost, and the
held run's records keep their order.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import psycopg
import pytest

import stopline
from stopline import OpStatus
from tests.postgres.server import server_url

pytestmark = pytest.mark.timeout(90)

RETRY_FOR = 120  # longer than the test's guard: a write that waits for the row never ends in it
GUARD = 45  # a guard against the stall, not a timing


@pytest.fixture
async def other(pg_url: str) -> AsyncIterator[psycopg.AsyncConnection[object]]:
    """Another session on the ledger's schema, in a transaction it leaves open."""
    schema = pg_url.split("schema=")[1].split("&")[0]
    conn = await psycopg.AsyncConnection.connect(server_url(), autocommit=True)
    try:
        await conn.execute(f'SET search_path = "{schema}"')
        await conn.execute("BEGIN")
        yield conn
    finally:
        await conn.close()


async def test_an_outcome_whose_row_is_held_waits_and_other_runs_calls_go_on(
    pg_url: str, other: psycopg.AsyncConnection[object]
) -> None:
    """The row of a call's operation is held when its outcome is written: the other
    run's calls go through meanwhile (they waited behind it, a lock timeout or more
    each); the held run's next call waits behind its outcome, in order; the receipt
    says the outcome is recording, not durable yet; once the row is let go, both land,
    the outcome before the next call's intent."""
    held = anyio.Event()
    sent: list[str] = []

    @stopline.tool
    async def hold(ctx: stopline.CallContext, text: str) -> str:
        await other.execute("SELECT id FROM operations WHERE id = %s FOR UPDATE", (ctx.op_id,))
        held.set()
        sent.append(ctx.key)
        return text

    @stopline.tool
    async def send(ctx: stopline.CallContext, text: str) -> str:
        sent.append(ctx.key)
        return text

    async with (
        stopline.open(pg_url + f"&retry_for={RETRY_FOR}") as ledger,
        ledger.run("a", owner="u", run_id="a") as a,
        ledger.run("b", owner="u", run_id="b") as b,
    ):
        assert await a.call(hold, "one", key="one") == "one"
        await held.wait()
        second = anyio.Event()

        async def next_call() -> None:
            await a.call(send, "two", key="two")
            second.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(next_call)
            with anyio.fail_after(GUARD):
                for n in range(5):
                    assert await b.call(send, str(n), key=f"k{n}") == str(n)
            receipt = await ledger.receipt("a")
            first = next(line for line in receipt.lines if line.op_id == "a/one")
            assert first.recording and first.status is OpStatus.REQUESTED
            assert not second.is_set()  # behind its run's outcome, the row still held
            assert "a/two" not in sent
            await other.execute("ROLLBACK")
            with anyio.fail_after(GUARD):
                await second.wait()
        ops = {op.id: op.status for op in await ledger.backend.operations("a")}
        assert ops == {"a/one": OpStatus.COMMITTED, "a/two": OpStatus.COMMITTED}
        kinds = [(e.op_id, e.kind) for e in await ledger.backend.events("a") if e.op_id]
        committed = kinds.index(("a/one", "committed"))
        assert committed < kinds.index(("a/two", "gate_passed"))
    assert sent == ["a/one", "b/k0", "b/k1", "b/k2", "b/k3", "b/k4", "a/two"]


async def test_a_gate_whose_run_row_is_held_waits_and_other_runs_calls_go_on(
    pg_url: str, other: psycopg.AsyncConnection[object]
) -> None:
    """A run's row is held when its call reaches the gate: the call waits (nothing
    sent) while another run's calls go through; once the row is let go it passes."""
    sent: list[str] = []

    @stopline.tool
    async def send(ctx: stopline.CallContext, text: str) -> str:
        sent.append(ctx.key)
        return text

    async with (
        stopline.open(pg_url + f"&retry_for={RETRY_FOR}") as ledger,
        ledger.run("h", owner="u", run_id="held") as held,
        ledger.run("f", owner="u", run_id="free") as free,
    ):
        await other.execute("SELECT id FROM runs WHERE id = 'held' FOR UPDATE")
        passed = anyio.Event()

        async def held_call() -> None:
            await held.call(send, "one", key="one")
            passed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(held_call)
            with anyio.fail_after(GUARD):
                for n in range(3):
                    assert await free.call(send, str(n), key=f"k{n}") == str(n)
            assert not passed.is_set() and "held/one" not in sent
            await other.execute("ROLLBACK")
            with anyio.fail_after(GUARD):
                await passed.wait()
    assert sent == ["free/k0", "free/k1", "free/k2", "held/one"]
