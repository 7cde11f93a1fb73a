"""The console's actions with odd input, and its ledger out of reach (probe 42).

A cancel that records nothing (a double submit, a stale page's form, a run that
ended meanwhile) said "Recorded in the ledger as console:<name>": the ledger holds
one cancel per run (R7), by whoever made it first. A "correct it" posted from a
stale form after another reviewer decided said "record it here (It happened)", of
an operation no longer in review. An embedding application's server with its
lifespan off got a raw AttributeError for every page.
"""

from __future__ import annotations

import re

import anyio
import httpx
import pytest
from starlette.testclient import TestClient

import stopline
from stopline.console import ConsoleConfig, create_app
from stopline.ledger.postgres import PostgresBackend
from tests.postgres.proxy import relayed
from tests.surfaces.seed import seed
from tests.surfaces.test_console_probe import FAST, _charge, _in_review

TOKEN = "probe42-token"
pytestmark = pytest.mark.timeout(120)


def _csrf(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found is not None
    return found[1]


def _said(page: str) -> str:
    found = re.search(r'data-testid="recorded">(.*?)</p>', page, re.S)
    assert found is not None, page
    return re.sub(r"<[^>]+>", "", found[1])


async def _events(url: str, run_id: str) -> list[tuple[str, object]]:
    async with stopline.open(url) as ledger:
        return [(str(e.kind), e.data.get("by")) for e in await ledger.backend.events(run_id)]


@pytest.mark.parametrize("ledger_backend", ["sqlite", "postgres"], indirect=True)
def test_a_cancel_that_records_nothing_says_so(ledger_url: str) -> None:
    ids = anyio.run(seed, ledger_url)

    async def ended() -> str:
        async with stopline.open(ledger_url) as ledger, ledger.run("done", owner="u:a") as run:
            run_id = run.id
        return run_id

    done = anyio.run(ended)
    app = create_app(ConsoleConfig(url=ledger_url, token=TOKEN))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get(f"/?token={TOKEN}&name=lee")
        csrf = _csrf(client.get(f"/runs/{ids.running}").text)
        first = client.post(f"/runs/{ids.running}/cancel", data={"csrf": csrf, "reason": "a"})
        assert first.status_code == 200
        assert _said(first.text).startswith("Recorded in the ledger as console:lee")
        cancels = [e for e in anyio.run(_events, ledger_url, ids.running) if e[0] == "cancel"]
        assert len(cancels) == 1
        # a cancel someone else made first (user:bob, before the page was opened)
        before = anyio.run(_events, ledger_url, ids.prevented)
        other = client.post(f"/runs/{ids.prevented}/cancel", data={"csrf": csrf, "reason": "b"})
        assert other.status_code == 200
        said = _said(other.text)
        assert said.startswith("Nothing recorded as console:lee: the run was cancelled already")
        assert "by user:bob" in said
        assert anyio.run(_events, ledger_url, ids.prevented) == before
        # a run that completed before the cancel
        before = anyio.run(_events, ledger_url, done)
        late = client.post(f"/runs/{done}/cancel", data={"csrf": csrf})
        assert late.status_code == 200
        assert "Nothing recorded as console:lee: the run had ended (completed)" in _said(late.text)
        assert "Recorded in the ledger" not in late.text
        assert anyio.run(_events, ledger_url, done) == before


@pytest.mark.parametrize("ledger_backend", ["sqlite", "postgres"], indirect=True)
def test_a_correction_posted_from_a_stale_form_is_the_ledgers_refusal(ledger_url: str) -> None:
    """Another reviewer decided while the queue was open; the stale form's "correct it"
    is 409 "not in review: it is committed", nothing recorded: not "record it here
    (It happened)", which the ledger would refuse in turn."""

    async def in_review() -> tuple[str, str]:
        async with stopline.open(ledger_url, verify=FAST) as ledger:
            return await _in_review(ledger, _charge())

    _, op_id = anyio.run(in_review)
    app = create_app(ConsoleConfig(url=ledger_url, token=TOKEN))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get(f"/?token={TOKEN}&name=lee")
        page = client.get("/review").text
        action = re.search(r'action="(/review/[^"]+/resolve)"', page)
        assert action is not None

        async def decide() -> int:
            async with stopline.open(ledger_url) as ledger:
                await ledger.resolve_review(op_id, "committed", by="user:1", note="seen it")
                return len((await ledger.backend.get_operation(op_id)).evidence)

        kept = anyio.run(decide)
        stale = client.post(action[1], data={"csrf": _csrf(page), "decision": "compensate"})
        assert stale.status_code == 409, stale.text
        assert "is not in review: it is committed" in stale.text
        assert "record it here" not in stale.text

    async def evidence() -> int:
        async with stopline.open(ledger_url) as ledger:
            return len((await ledger.backend.get_operation(op_id)).evidence)

    assert anyio.run(evidence) == kept


async def test_an_embedded_console_serves_with_its_server_lifespan_off(tmp_path: object) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    async with stopline.open(url) as ledger:
        async with ledger.run("job", owner="user:ada", run_id="r1"):
            pass
        app = create_app(ConsoleConfig(url=url, token=TOKEN), ledger=ledger)
        transport = httpx.ASGITransport(app=app)  # it runs no lifespan
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            page = await c.get(f"/runs/r1?token={TOKEN}", follow_redirects=True)
            assert page.status_code == 200 and "Completed." in page.text


async def test_a_postgres_ledger_out_of_reach_is_503_and_the_console_recovers(
    pg_url: str,
) -> None:
    """The server stops answering and takes no new session while the console is open:
    every page and the cancel answer 503 with Retry-After in bounded time, nothing
    hangs and no receipt is claimed; once the server is back the pages serve again and
    the cancel goes through, recorded under the session's principal."""
    ids = await seed(pg_url)
    async with relayed(pg_url) as (relay, url):
        url += "&retry_for=2&pool_min=1&pool_max=2"
        async with stopline.open(url) as ledger:
            backend = ledger.backend
            assert isinstance(backend, PostgresBackend)
            backend.answer_wait = 1.0
            app = create_app(ConsoleConfig(url=url, token=TOKEN), ledger=ledger)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
                await c.get(f"/?token={TOKEN}&name=lee", follow_redirects=True)
                csrf = _csrf((await c.get(f"/runs/{ids.running}")).text)
                relay.freeze()
                relay.refuse = True
                for path in ("/", f"/runs/{ids.running}", "/review", "/stats"):
                    with anyio.fail_after(60):  # a guard against a hang, not a timing
                        page = await c.get(path)
                    assert page.status_code == 503, (path, page.text)
                    assert page.headers["retry-after"] == "1"
                    assert "no answer from the server" in page.text
                with anyio.fail_after(60):
                    refused = await c.post(f"/runs/{ids.running}/cancel", data={"csrf": csrf})
                assert refused.status_code == 503 and "Canceled" not in refused.text
                relay.refuse = False
                relay.thaw()
                await relay.drained()
                for _ in range(10):  # a pooled session held since the freeze fails once
                    if (await c.get("/")).status_code == 200:
                        break
                else:
                    pytest.fail("the console did not recover with its ledger")
                assert (await c.get(f"/runs/{ids.running}")).status_code == 200
                done = await c.post(f"/runs/{ids.running}/cancel", data={"csrf": csrf})
                assert done.status_code == 200
                assert "Canceled before external action." in done.text
                assert _said(done.text).startswith("Recorded in the ledger as console:lee")


def test_a_cancels_answer_does_not_say_it_follows_the_run(tmp_path: object) -> None:
    """The answer to a cancel is a page that does not refresh: its recovery line said
    "wait until it settles (this page follows it)"; it is the run page that does."""
    url = f"sqlite:///{tmp_path}/ledger.db"
    ids = anyio.run(seed, url)
    app = create_app(ConsoleConfig(url=url, token=TOKEN))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get(f"/?token={TOKEN}&name=lee")
        page = client.get(f"/runs/{ids.running}").text
        answer = client.post(f"/runs/{ids.running}/cancel", data={"csrf": _csrf(page)})
        assert answer.status_code == 200
        assert "data-live" not in answer.text  # it does not refresh
        line = re.search(r'data-testid="recovery">(.*?)</div>', answer.text, re.S)
        assert line is not None
        assert "wait until it settles (its run page follows it)" in line[1]
        assert "this page follows it" not in answer.text
