"""ADR 0066: the console says each recovery step the way its reader takes it: waiting and
review on its own pages, a resume as the CLI's command (the console has none), never
a library call."""

from __future__ import annotations

import html
import re
from pathlib import Path

import anyio
import pytest
from starlette.testclient import TestClient

from stopline.console import ConsoleConfig, create_app
from tests.surfaces.seed import seed
from tests.surfaces.test_advice_cli import left_settling

pytestmark = pytest.mark.timeout(120)

TOKEN = "t0ken-for-advice"


def recovery(page: str) -> str:
    match = re.search(r'<div class="muted" data-testid="recovery">resume: (.*?)</div>', page)
    assert match is not None, page
    return html.unescape(match[1])


def test_the_console_says_each_step_in_its_own_terms(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ids = anyio.run(seed, url)
    settling_id = anyio.run(left_settling, url)
    client = TestClient(
        create_app(ConsoleConfig(url=url, token=TOKEN)), base_url="http://127.0.0.1"
    )
    with client:
        client.get(f"/?token={TOKEN}&name=ada")
        stopped = recovery(client.get(f"/runs/{ids.verified}").text)
        in_review = recovery(client.get(f"/runs/{ids.review}").text)
        settling = recovery(client.get(f"/runs/{settling_id}").text)
    for line in (stopped, in_review, settling):
        assert "ledger." not in line
    assert stopped.startswith(
        f"resume with `stopline resume {ids.verified}` (the console does not resume runs), "
        "then re-enter the run from your application with the same run id: 1 completed "
        "action is returned from the ledger, not repeated"
    )
    assert in_review.startswith(
        "a reviewer decides 1 operation in review (on the Review queue page)"
    )
    assert settling.startswith("wait until it settles (this page follows it)")
