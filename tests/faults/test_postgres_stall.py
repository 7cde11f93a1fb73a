"""A PostgreSQL server that stops answering without closing the connection (ADR 0061).

A frozen backend, a paused host, a network that drops packets while the socket stays
open: the client's statement is sent and acknowledged, and no answer comes. A
ledger's writes are shielded (a started write finishes), so the caller waited for
ever, its own timeout included, and every run of the process behind it. Now a
statement unanswered within ``answer_wait`` drops its connection as lost; and a
write whose reply was lost is settled by reading the ledger only once the session it
went out on is gone: until then, not found is "not yet" (the statement may still
land), not "did not land". The relay (``tests.postgres.proxy``) holds a
connection's bytes without closing it, as such a server or network does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import psycopg
import pytest

import stopline
from stopline import OpStatus
from stopline.errors import GateInDoubt, LedgerUnavailable
from stopline.ledger.postgres import PostgresBackend
from tests.postgres.proxy import Relay, relayed
from tests.postgres.server import server_url

pytestmark = pytest.mark.timeout(60)  # a guard against the hang itself, not a timing

POOL_MAX = 2
ANSWER_WAIT = 1.0  # seconds a statement's answer is waited for (the default: 5 at least)


@pytest.fixture
async def relay_url(pg_url: str) -> AsyncIterator[tuple[Relay, str]]:
    async with relayed(pg_url) as pair:
        yield pair


def rows(pg_url: str, sql: str) -> list[tuple[str, ...]]:
    """Read the ledger's tables on the server directly, around the relay."""
    schema = pg_url.split("schema=")[1].split("&")[0]
    with psycopg.connect(server_url(), autocommit=True) as conn:
        conn.execute(f'SET search_path = "{schema}"')
        return [tuple(map(str, row)) for row in conn.execute(sql.encode()).fetchall()]


@stopline.tool
async def send(text: str) -> str:
    sent.append(text)
    return text


sent: list[str] = []


async def test_a_server_that_stops_answering_fails_the_call_typed_and_its_late_gate_is_settled(
    pg_url: str, relay_url: tuple[Relay, str]
) -> None:
    """The server stops answering mid-call and takes no new session: the call raises
    ``GateInDoubt`` (nothing sent) instead of waiting for ever. Once new sessions reach
    the server, the gate in doubt is settled only after the session it went out on is
    gone: the statement held on the way cannot land after the read found nothing, so
    no intent is left ``requested`` (a receipt's "sent; no answer yet") for a call
    that was never dispatched."""
    relay, url = relay_url
    sent.clear()
    async with stopline.open(url + f"&retry_for=2&pool_min=1&pool_max={POOL_MAX}") as ledger:
        backend = ledger.backend
        assert isinstance(backend, PostgresBackend)
        backend.answer_wait = ANSWER_WAIT
        async with ledger.run("a", owner="u", run_id="a") as run:
            assert await run.call(send, "one", key="one") == "one"
            relay.freeze()
            relay.refuse = True
            with pytest.raises(GateInDoubt):
                await run.call(send, "two", key="two")
            assert sent == ["one"]  # the second was never dispatched
            relay.refuse = False  # new sessions reach the server; those held are still held
            errors: list[LedgerUnavailable] = []
            for _ in range(POOL_MAX + 1):  # a transaction: it settles the gate in doubt
                try:  # on a pooled session held since the freeze, after a typed error
                    await ledger.receipt("a")
                    break
                except LedgerUnavailable as exc:
                    errors.append(exc)
            else:
                pytest.fail("no transaction reached the server on a new session")
            assert all("no answer from the server" in str(e) for e in errors)
            relay.thaw()  # what the held session had on the way reaches the server now
            await relay.drained()
        statuses = {op: status for op, status in rows(pg_url, "SELECT id, status FROM operations")}
        assert statuses.pop("a/one") == OpStatus.COMMITTED.value
        # never dispatched: not there, or (had it landed first) unknown, read back; never
        # "requested" with nobody left to settle it
        assert statuses in ({}, {"a/two": OpStatus.UNKNOWN.value})
        text = (await ledger.receipt("a")).text()
        assert "no answer yet" not in text


async def test_a_call_whose_session_stops_answering_goes_through_on_another_once_it_is_gone(
    pg_url: str, relay_url: tuple[Relay, str]
) -> None:
    """The server stops answering one session while new ones get through: the call's
    gate is dropped after ``answer_wait``, its old session ended, the read finds the
    gate not landed, and the gate runs again on another session: the call is sent
    once, and the statement held on the way lands nowhere when released."""
    relay, url = relay_url
    sent.clear()
    async with stopline.open(url + "&retry_for=30") as ledger:
        backend = ledger.backend
        assert isinstance(backend, PostgresBackend)
        backend.answer_wait = ANSWER_WAIT
        async with ledger.run("b", owner="u", run_id="b") as run:
            assert await run.call(send, "one", key="one") == "one"
            relay.freeze()  # every session open now; later ones get through
            assert await run.call(send, "two", key="two") == "two"
            relay.thaw()
            await relay.drained()
            assert await run.call(send, "three", key="three") == "three"
        assert sent == ["one", "two", "three"]
        found = rows(pg_url, "SELECT id, status, attempts FROM operations ORDER BY id")
        assert found == [
            ("b/one", "committed", "1"),
            ("b/three", "committed", "1"),
            ("b/two", "committed", "1"),
        ]
