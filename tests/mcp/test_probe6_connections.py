"""A second ``StoplineMCP`` connection of one name, in one ledger (ADR 0086 amended).

A tool's read-back was bound to the connection object it was declared on
(``functools.partial(read_back, conn, name)``, a ``verifiers=`` function wrapped
over ``conn``). The ledger keeps one tool per name (ADR 0078): the same server's
tool through another connection of the same name (one per request, one opened
again after the first ended) was "another tool under a known name", and every
call of it failed before its gate, for as long as the ledger was open. The
read-back is one declaration per server name and tool, and reads a call back
through the connection the call went through.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from stopline import OpStatus, Policy, ReadBack, Verdict
from stopline.domain.vocab import PhaseKind
from stopline.integrations.mcp import StoplineMCP
from tests.mcp.conftest import Server, stdio_params

pytestmark = pytest.mark.timeout(90)


def connection(db: Path, **options: Any) -> StoplineMCP:
    return StoplineMCP(stdio_params(db), mode="legacy", name="testing", **options)


async def test_a_second_connection_of_one_name_is_gated_and_read_back_through_itself(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    db = tmp_path / "effects.db"
    async with connection(db) as first, ledger.run("probe", run_id="conn-1", owner="user:1") as run:
        await first.call(run, "upload", {"payload": "Q3"})
    async with connection(db) as conn:  # the first one has ended
        server = Server(conn, "stdio-legacy")
        async with ledger.run("probe", run_id="conn-2", owner="user:1") as run:
            answer = await conn.call(run, "upload", {"payload": "Q4"})
        assert answer["value"] == "Q4"
        (op,) = await ledger.backend.operations("conn-2")
        assert op.status is OpStatus.COMMITTED
        assert len(await server.effects_of(op.id)) == 1

        async def notify() -> None:
            async with (
                ledger.run("probe", run_id="conn-3", owner="user:1") as run,
                run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),
            ):
                await conn.call(run, "notify", {"payload": "#finance"})

        await server.hold("committed:notify")
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(notify)
                key = await server.reached("committed:notify")
                await ledger.cancel("conn-3", by="user:1")
            await ledger.wait_settled("conn-3", timeout=30)
        finally:
            await server.release("committed:notify")
        assert len(await server.effects_of(key)) == 1
    op = await ledger.backend.get_operation(key)
    # read back through the connection the call went through, not the first (ended)
    assert op.status is OpStatus.COMMITTED
    kinds = [e.kind for e in await ledger.backend.events("conn-3") if e.op_id == key]
    assert kinds.index("lost") < kinds.index("verified_committed")


async def test_connections_with_one_declared_verifier_are_one_declaration(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """A ``verifiers=`` function of the user's, the same for every connection: one
    declaration; another function under that name is still refused (ADR 0078)."""

    async def found(ctx: stopline.CallContext) -> ReadBack:
        return ReadBack(Verdict.COMMITTED, ref=ctx.key)

    async def other(ctx: stopline.CallContext) -> ReadBack:
        return ReadBack(Verdict.NOT_COMMITTED, ref=ctx.key)

    db = tmp_path / "effects.db"
    for i in range(2):
        async with (
            connection(db, verifiers={"upload": found}) as conn,
            ledger.run("probe", run_id=f"v-{i}", owner="user:1") as run,
        ):
            await conn.call(run, "upload", {"payload": f"Q{i}"})
    async with connection(db, verifiers={"upload": other}) as conn:
        with pytest.raises(stopline.InvalidInput, match="names another tool"):
            async with ledger.run("probe", run_id="v-other", owner="user:1") as run:
                await conn.call(run, "upload", {"payload": "Q9"})
    statuses = [op.status for i in range(2) for op in await ledger.backend.operations(f"v-{i}")]
    assert statuses == [OpStatus.COMMITTED, OpStatus.COMMITTED]
    assert await ledger.backend.operations("v-other") == []


async def test_two_servers_given_one_name_are_still_two_tools(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """One name, two servers (another ``--db``: another command line): the second is
    refused, as before. Reading one's calls back through the other would hear "not
    found" from a server that never saw them, and end them ``not_committed``."""
    async with connection(tmp_path / "a.db") as a, ledger.run("a", owner="user:1") as run:
        await a.call(run, "upload", {"payload": "Q1"})
    async with connection(tmp_path / "b.db") as b:
        with pytest.raises(stopline.InvalidInput, match="names another tool"):
            async with ledger.run("probe", run_id="b-1", owner="user:1") as run:
                await b.call(run, "upload", {"payload": "Q2"})
    assert await ledger.backend.operations("b-1") == []
