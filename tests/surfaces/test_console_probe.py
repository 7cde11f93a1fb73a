"""The console's review guidance and run pages, checked from outside as a user meets them.

A correction runs a tool's compensator, code only the application has: the console
offers "It happened: correct it" only when the ledger it was given can run it, and
says where to do it otherwise (following that works). A run waiting for a reviewer
is not "settled: this will not change": its page says who it waits for and follows
the decision.
"""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import httpx
from starlette.testclient import TestClient

import stopline
from stopline import Cancellable, Headline, OpStatus, Policy
from stopline.console import ConsoleConfig, create_app
from stopline.testing import FakeProvider
from tests.scenarios.workflows import calls, start
from tests.surfaces.browser import CHROMIUM, CHROMIUM_ARGS, console_server, require_chromium

TOKEN = "probe-token"
FAST = stopline.VerifyBudget(attempts=2, first_delay=0.01, factor=1.0, max_delay=0.01)


def _charge() -> FakeProvider:
    """A charge with a compensator and no read-back: in review once its answer is lost."""
    return FakeProvider(
        "charge_card",
        cancellable=Cancellable.NEVER,
        verifiable=False,
        compensable=True,
        description="charge card 4242",
    )


async def _in_review(ledger: stopline.Ledger, charge: FakeProvider) -> tuple[str, str]:
    """A run cancelled after the charge committed, its answer lost: (run id, op id)."""
    held = charge.hold("committed")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(charge, policy=Policy.IMMEDIATE))
        await held.reached.wait()
        await ledger.cancel(started.run_id, by="user:1", reason="stop")
        held.release()
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.headline is Headline.NEEDS_REVIEW
    [item] = await ledger.review_items()
    return started.run_id, item.op.id


async def _seed_review(url: str, charge: FakeProvider) -> tuple[str, str]:
    async with stopline.open(url, verify=FAST) as ledger:
        return await _in_review(ledger, charge)


def _form(page: str) -> tuple[str, str]:
    action = re.search(r'action="(/review/[^"]+/resolve)"', page)
    csrf = re.search(r'name="csrf" value="([^"]+)"', page)
    assert action is not None and csrf is not None
    return action[1], csrf[1]


def test_the_console_offers_no_correction_it_cannot_make_and_says_where(
    tmp_path: Path,
) -> None:
    """``stopline console`` loads no tools: its "correct it" button always ended in a 409
    saying to pass the tool to stopline.open, which no one can do from a browser."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    charge = _charge()  # the provider: what it holds is what a correction undoes
    _, op_id = anyio.run(_seed_review, url, charge)
    app = create_app(ConsoleConfig(url=url, token=TOKEN))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get(f"/?token={TOKEN}&name=lee")
        queue = client.get("/review").text
        assert 'value="compensate"' not in queue
        note = queue.split('data-testid="correct-elsewhere">', 1)[1].split("</div>", 1)[0]
        assert "compensator of tool &#39;charge_card&#39;" in note
        assert "ledger.compensate(" in note and "ledger.resolve_review(" in note
        action, csrf = _form(queue)
        refused = client.post(action, data={"csrf": csrf, "decision": "compensate"})
        assert refused.status_code == 409
        assert "not corrected from here" in refused.text
        assert "stopline.open(url, tools=" not in refused.text
        # nothing was written: the item still waits; then the advice, followed
        assert f'data-op="{op_id}"' in client.get("/review").text
        happened = client.post(action, data={"csrf": csrf, "decision": "committed"})
        assert happened.status_code == 200

    async def correct_from_the_application() -> stopline.OperationRecord:
        async with stopline.open(url, tools=[charge.tool]) as ledger:
            return await ledger.compensate(op_id, by="user:1")

    assert anyio.run(correct_from_the_application).status is OpStatus.COMPENSATED


async def test_an_embedding_ledger_with_the_tool_offers_the_correction(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    charge = _charge()
    async with stopline.open(url, verify=FAST) as ledger:
        run_id, op_id = await _in_review(ledger, charge)
        app = create_app(ConsoleConfig(url=url, token=TOKEN), ledger=ledger)
        # served in the ledger's own loop, as an application serves it beside its ledger
        # (a correction is made in the loop that opened the ledger: ADR 0086)
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client,
        ):
            await client.get(f"/?token={TOKEN}&name=lee")
            queue = (await client.get("/review")).text
            assert 'value="compensate"' in queue and "correct-elsewhere" not in queue
            action, csrf = _form(queue)
            done = await client.post(action, data={"csrf": csrf, "decision": "compensate"})
            assert done.status_code == 200, done.text
        await ledger.wait_settled(run_id, timeout=20)
        corrected = await ledger.backend.get_operation(op_id)
    assert corrected.status is OpStatus.COMPENSATED, corrected.status


async def test_a_run_page_waiting_for_review_follows_the_decision(tmp_path: Path) -> None:
    """The page of a run in review said "settled: this will not change" and stopped
    refreshing; a reviewer's decision (here from another process) changes it."""
    require_chromium()
    from playwright.async_api import async_playwright, expect

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    run_id, op_id = await _seed_review(url, _charge())
    async with console_server(url, TOKEN) as base, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(f"{base}/runs/{run_id}?token={TOKEN}")
            receipt = page.get_by_test_id("receipt")
            await expect(receipt).to_contain_text("Status unknown; human review required.")
            await expect(receipt).to_contain_text("waits for a reviewer")
            await expect(receipt).not_to_contain_text("will not change")
            await expect(page.get_by_test_id("live-status")).to_have_attribute("data-state", "live")
            async with stopline.open(url) as reviewer:
                await reviewer.resolve_review(op_id, "not_committed", by="user:1")
            await expect(receipt).to_contain_text(
                "Canceled before external action.", timeout=15_000
            )
            await expect(receipt).to_contain_text("settled: nothing changes it by itself")
            await expect(page.get_by_test_id("live-status")).to_have_attribute(
                "data-state", "settled", timeout=15_000
            )
        finally:
            await browser.close()


def test_an_unknown_state_filter_is_refused_not_read_as_every_run(tmp_path: Path) -> None:
    """``/?state=bogus`` listed every run under "Runs", as if the filter applied."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    app = create_app(ConsoleConfig(url=url, token=TOKEN))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get(f"/?token={TOKEN}")
        refused = client.get("/?state=bogus")
        assert refused.status_code == 400
        assert "state: &#39;bogus&#39; is not a run state" in refused.text
        assert client.get("/?state=needs_review").status_code == 200


def test_a_deleted_ledger_says_a_restart_is_what_helps(tmp_path: Path) -> None:
    """The ledger's file deleted under the console: every page is 500 naming it, and
    the page says what helps (asking again does not, even once the file is back)."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    anyio.run(_seed_review, url, _charge())
    app = create_app(ConsoleConfig(url=url, token=TOKEN))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get(f"/?token={TOKEN}")
        assert client.get("/").status_code == 200
        path.rename(tmp_path / "moved.db")
        for page in ("/", "/review", "/stats"):
            gone = client.get(page)
            assert gone.status_code == 500 and "was deleted" in gone.text
            assert "restart the console" in gone.text
    (tmp_path / "moved.db").rename(path)
    with TestClient(create_app(ConsoleConfig(url=url, token=TOKEN))) as again:
        again.get(f"http://127.0.0.1/?token={TOKEN}")
        assert again.get("http://127.0.0.1/review").status_code == 200
