"""The console's access rules over HTTP: token once, HttpOnly cookie, CSRF on every write."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
from starlette.testclient import TestClient

import stopline
from stopline.console import ConsoleConfig, create_app
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
