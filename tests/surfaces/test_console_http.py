"""The console's access rules over HTTP: token once, HttpOnly cookie, CSRF on every write."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import anyio
from starlette.testclient import TestClient

import stopline
from stopline.console import ConsoleConfig, create_app
from stopline.domain.model import OperationSpec
from stopline.domain.vocab import Cancellable
from stopline.ledger.backend import RunSpec
from tests.surfaces.seed import seed

TOKEN = "t0ken-for-tests"


def client_for(tmp_path: Path) -> tuple[TestClient, str, str]:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ids = anyio.run(seed, url)
    app = create_app(ConsoleConfig(url=url, token=TOKEN))
    return TestClient(app, base_url="http://127.0.0.1"), url, ids.running


def test_every_page_needs_the_token(tmp_path: Path) -> None:
    client, _, run_id = client_for(tmp_path)
    with client:
        for path in ("/", f"/runs/{run_id}", "/review"):
            assert client.get(path).status_code == 401
        assert client.get("/?token=wrong").status_code == 403
        login = client.get(f"/?token={TOKEN}&name=ada", follow_redirects=False)
        assert login.status_code == 303
        assert login.headers["location"] == "/"
        cookie = login.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie
        page = client.get("/")
        assert page.status_code == 200
        assert run_id in page.text
        assert "acting as <b>console:ada</b>" in page.text
        assert "script-src 'nonce-" in page.headers["content-security-policy"]


def test_cancel_needs_the_csrf_token_and_records_the_principal(tmp_path: Path) -> None:
    client, url, run_id = client_for(tmp_path)
    with client:
        client.get(f"/?token={TOKEN}&name=ada")
        page = client.get(f"/runs/{run_id}")
        match = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert match is not None
        refused = client.post(f"/runs/{run_id}/cancel", data={"reason": "x"})
        assert refused.status_code == 403
        forged = client.post(f"/runs/{run_id}/cancel", data={"csrf": "guess", "reason": "x"})
        assert forged.status_code == 403
        done = client.post(f"/runs/{run_id}/cancel", data={"csrf": match[1], "reason": "stop it"})
        assert done.status_code == 200
        assert "Canceled before external action." in done.text

    async def recorded() -> stopline.RunRecord:
        async with stopline.open(url) as ledger:
            return await ledger.backend.get_run(run_id)

    run = anyio.run(recorded)
    assert run.cancelled_by == "console:ada"
    assert run.cancel_reason == "stop it"


def test_review_queue_lists_what_needs_a_human(tmp_path: Path) -> None:
    client, _, _ = client_for(tmp_path)
    with client:
        client.get(f"/?token={TOKEN}")
        page = client.get("/review")
        assert page.status_code == 200
        assert "charge card 4242 for 120 EUR" in page.text
        assert client.get("/runs/run_nope").status_code == 404


def test_a_foreign_host_or_origin_is_refused(tmp_path: Path) -> None:
    client, _, run_id = client_for(tmp_path)
    with client:
        assert client.get(f"/?token={TOKEN}").status_code == 200
        rebound = client.get("/", headers={"host": "attacker.example"})
        assert rebound.status_code == 403
        assert "host 'attacker.example' is not allowed" in rebound.text
        assert client.get("/", headers={"host": "localhost:8765"}).status_code == 200
        assert client.get("/", headers={"host": "[::1]:8765"}).status_code == 200
        page = client.get(f"/runs/{run_id}")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        cross = client.post(
            f"/runs/{run_id}/cancel",
            data={"csrf": csrf[1], "reason": "x"},
            headers={"origin": "http://attacker.example"},
        )
        assert cross.status_code == 403 and "origin" in cross.text
        null = client.post(
            f"/runs/{run_id}/cancel", data={"csrf": csrf[1]}, headers={"origin": "null"}
        )
        assert null.status_code == 403
        assert client.get(f"/runs/{run_id}").text.count("Cancel run") == 1  # nothing happened
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    configured = create_app(ConsoleConfig(url=url, token=TOKEN, allowed_hosts=("ops.internal",)))
    with TestClient(configured, base_url="http://ops.internal") as other:
        assert other.get(f"/?token={TOKEN}").status_code == 200


async def _odd_run(url: str, run_id: str) -> None:
    async with stopline.open(url) as ledger:
        await ledger.backend.create_run(
            RunSpec(id=run_id, name="odd", owner="user:ada", tenant="default")
        )


def test_ids_with_reserved_characters_are_url_encoded(tmp_path: Path) -> None:
    client, url, _ = client_for(tmp_path)
    odd = "run_50%?of#these/x"
    anyio.run(_odd_run, url, odd)
    with client:
        client.get(f"/?token={TOKEN}")
        listing = client.get("/").text
        link = "/runs/run_50%25%3Fof%23these%2Fx"
        assert f'href="{link}"' in listing
        page = client.get(link)
        assert page.status_code == 200 and "run_50%?of#these/x" in page.text
        assert f'action="{link}/cancel"' in page.text
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        done = client.post(f"{link}/cancel", data={"csrf": csrf[1], "reason": "odd"})
        assert done.status_code == 200 and "Canceled before external action." in done.text
        assert f'href="{link}"' in done.text


def test_the_run_page_draws_the_timeline_and_stats_the_settle_chart(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ids = anyio.run(seed, url)
    app = create_app(ConsoleConfig(url=url, token=TOKEN))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get(f"/?token={TOKEN}")
        page = client.get(f"/runs/{ids.verified}").text
        svg = page.split('data-testid="timeline-svg"', 1)[1].split("</svg>", 1)[0]
        assert svg.count('data-mark="cancel"') == 1
        assert svg.count('data-mark="settled"') == 1
        assert 'data-phase="calling_external"' in svg
        assert 'data-status="committed"' in svg and "post to #releases" in svg
        review = client.get(f"/runs/{ids.review}").text
        assert 'data-status="needs_review"' in review
        assert "needs review" in review.split('data-testid="timeline-svg"', 1)[1]
        stats = client.get("/stats").text
        chart = stats.split('data-testid="settle-chart"', 1)[1].split("</svg>", 1)[0]
        assert 'data-mark="p50"' in chart and 'data-mark="p99"' in chart
        assert sum(int(n) for n in re.findall(r'data-count="(\d+)"', chart)) == 3


async def _hostile(url: str) -> str:
    async with stopline.open(url) as ledger:
        run = await ledger.backend.create_run(
            RunSpec(id="run_x", name="x", owner="user:ada", tenant="default")
        )
        await ledger.backend.gate(
            OperationSpec(
                id="run_x/1:t",
                run_id=run.id,
                tool="t",
                args_digest="sha256:0",
                description="<script>alert(1)</script>",
                cancellable=Cancellable.NEVER,
                can_verify=False,
                can_compensate=False,
            )
        )
        return run.id


def test_what_the_pictures_show_is_escaped(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    run_id = anyio.run(_hostile, url)
    app = create_app(ConsoleConfig(url=url, token=TOKEN))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get(f"/?token={TOKEN}")
        page = client.get(f"/runs/{run_id}").text
        assert "<script>alert" not in page
        svg = page.split('data-testid="timeline-svg"', 1)[1].split("</svg>", 1)[0]
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in svg


def test_a_review_item_is_resolved_from_the_console(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ids = anyio.run(seed, url)
    app = create_app(ConsoleConfig(url=url, token=TOKEN))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get(f"/?token={TOKEN}&name=lee")
        queue = client.get("/review").text
        action = re.search(r'action="(/review/[^"]+/resolve)"', queue)
        csrf = re.search(r'name="csrf" value="([^"]+)"', queue)
        assert action is not None and csrf is not None
        assert "%2F" in action[1]  # the operation id's "/" is encoded
        bad = client.post(action[1], data={"csrf": csrf[1], "decision": "maybe"})
        assert bad.status_code == 400 and "not one of" in bad.text
        done = client.post(
            action[1], data={"csrf": csrf[1], "decision": "committed", "note": "card statement"}
        )
        assert done.status_code == 200
        assert "Stopped. 1 action had already completed and was kept." in done.text
        assert "nothing waits for review" in client.get("/review").text

    async def evidence() -> list[tuple[str, str]]:
        async with stopline.open(url) as ledger:
            (op,) = await ledger.backend.operations(ids.review)
            return [(e.kind.value, e.ref) for e in op.evidence]

    assert ("review", "console:lee") in anyio.run(evidence)


def test_an_id_or_a_name_no_ledger_can_hold_is_a_bad_request(pg_url: str) -> None:
    """A NUL in a URL's run or operation id, or in the login name, on PostgreSQL: a
    400 naming it. The run page was a 409 with the driver's words, and a name with
    a NUL logged in and failed at its first cancel."""
    ids = anyio.run(seed, pg_url)
    client = TestClient(
        create_app(ConsoleConfig(url=pg_url, token=TOKEN)), base_url="http://127.0.0.1"
    )
    with client:
        refused = client.get(f"/?token={TOKEN}&name=a%00b")
        assert refused.status_code == 400 and "contains a NUL character" in refused.text
        client.get(f"/?token={TOKEN}&name=ada")
        page = client.get("/runs/x%00y")
        assert page.status_code == 400 and "invalid run_id: contains a NUL" in page.text
        listing = client.get(f"/runs/{ids.running}")
        csrf = re.search(r'name="csrf" value="([^"]+)"', listing.text)
        assert csrf is not None
        review = client.post(
            "/review/o%00/resolve", data={"csrf": csrf[1], "decision": "committed"}
        )
        assert review.status_code == 400 and "invalid op_id" in review.text
        cancel = client.post("/runs/x%00y/cancel", data={"csrf": csrf[1]})
        assert cancel.status_code == 400 and "invalid run_id" in cancel.text
        assert client.get(f"/runs/{ids.running}").status_code == 200


def test_a_busy_ledger_is_503_with_retry_after_and_a_conflict_stays_409(tmp_path: Path) -> None:
    """Another process holding SQLite's write lock made a cancel a 409, as if the run
    had refused it; the ledger is busy, and asking again once it is free works."""
    path = tmp_path / "ledger.db"
    ids = anyio.run(seed, f"sqlite:///{path}")
    app = create_app(ConsoleConfig(url=f"sqlite:///{path}?busy_timeout=0.2", token=TOKEN))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get(f"/?token={TOKEN}")
        page = client.get(f"/runs/{ids.running}")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        holder = sqlite3.connect(path, isolation_level=None)
        try:
            holder.execute("BEGIN EXCLUSIVE")  # as another process's write transaction
            busy = client.post(f"/runs/{ids.running}/cancel", data={"csrf": csrf[1]})
            assert busy.status_code == 503, busy.text
            assert busy.headers["retry-after"] == "1"
            assert "database is locked" in busy.text
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        done = client.post(f"/runs/{ids.running}/cancel", data={"csrf": csrf[1]})
        assert done.status_code == 200 and "Canceled before external action." in done.text
        review = client.get("/review").text
        action = re.search(r'action="(/review/[^"]+/resolve)"', review)
        assert action is not None
        decided = {"csrf": csrf[1], "decision": "committed"}
        assert client.post(action[1], data=decided).status_code == 200
        again = client.post(action[1], data=decided)  # no longer in review: a conflict
        assert again.status_code == 409 and "retry-after" not in again.headers
        assert "is not in review: it is committed" in again.text


def test_a_ledger_that_cannot_serve_is_500_not_a_conflict(tmp_path: Path) -> None:
    """The ledger's file deleted under the console: its pages and its cancel were a
    409, as if the contract had refused the cancel; it is a ledger that cannot serve,
    named, and no receipt is shown."""
    path = tmp_path / "ledger.db"
    ids = anyio.run(seed, f"sqlite:///{path}")
    app = create_app(ConsoleConfig(url=f"sqlite:///{path}", token=TOKEN))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get(f"/?token={TOKEN}")
        page = client.get(f"/runs/{ids.running}")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        for suffix in ("", "-wal", "-shm"):
            (tmp_path / f"ledger.db{suffix}").unlink(missing_ok=True)
        gone = client.post(f"/runs/{ids.running}/cancel", data={"csrf": csrf[1]})
        assert gone.status_code == 500, gone.text
        assert "deleted" in gone.text and "Canceled" not in gone.text
        assert client.get("/").status_code == 500


def test_a_cancel_reason_is_kept_whole_and_a_long_note_is_refused(tmp_path: Path) -> None:
    """The console cut a cancel's reason at 500 characters and a review note at 1,000,
    saying nothing: the audit record was not what the operator wrote. A reason is kept
    as the ledger keeps it (whole up to its limit); a note too long is refused, named,
    and the review is left open."""
    client, url, run_id = client_for(tmp_path)
    reason = "why " * 400  # 1,600 characters
    with client:
        client.get(f"/?token={TOKEN}")
        page = client.get(f"/runs/{run_id}")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        done = client.post(f"/runs/{run_id}/cancel", data={"csrf": csrf[1], "reason": reason})
        assert done.status_code == 200
        review = client.get("/review").text
        action = re.search(r'action="(/review/[^"]+/resolve)"', review)
        assert action is not None
        long = {"csrf": csrf[1], "decision": "committed", "note": "n" * 1001}
        refused = client.post(action[1], data=long)
        assert refused.status_code == 400 and "1,001 characters; at most 1,000" in refused.text
        assert action[1] in client.get("/review").text  # still in review

    async def recorded() -> stopline.RunRecord:
        async with stopline.open(url) as ledger:
            return await ledger.backend.get_run(run_id)

    assert anyio.run(recorded).cancel_reason == reason.strip()


def test_every_response_carries_the_security_headers(tmp_path: Path) -> None:
    """The token's redirect, the host guard's 403 and an unknown path's 404 carried
    none of the documented headers but the redirect's referrer policy (a page's own are
    kept: its CSP holds its nonce)."""
    client, _, run_id = client_for(tmp_path)
    with client:
        redirect = client.get(f"/?token={TOKEN}", follow_redirects=False)
        foreign = client.get("/", headers={"host": "evil.example"})
        unknown = client.get("/no/such/page")
        page = client.get(f"/runs/{run_id}")
    assert redirect.status_code == 303 and redirect.headers["referrer-policy"] == "no-referrer"
    assert foreign.status_code == 403 and unknown.status_code == 404
    for response in (redirect, foreign, unknown, page):
        assert response.headers["x-frame-options"] == "DENY"
        assert response.headers["cache-control"] == "no-store"
        assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
    assert "nonce-" in page.headers["content-security-policy"]
