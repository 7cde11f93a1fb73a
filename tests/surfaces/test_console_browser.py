"""The console in a real headless Chromium: see a running run, cancel it, read the receipt."""

from __future__ import annotations

import anyio

import stopline
from stopline import Cancellable
from stopline.testing import FakeProvider
from tests.scenarios.workflows import calls, start
from tests.surfaces.browser import CHROMIUM, CHROMIUM_ARGS, console_server, require_chromium

TOKEN = "browser-test-token"


async def test_cancel_a_running_run_from_the_console(
    ledger: stopline.Ledger, ledger_url: str
) -> None:
    require_chromium()
    from playwright.async_api import async_playwright, expect

    deploy = FakeProvider(
        "deploy", cancellable=Cancellable.UNTIL_ACCEPTED, description="deploy v2 to production"
    )
    held = deploy.hold("accepted")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(deploy))
        await held.reached.wait()  # the provider accepted the deploy and is working on it
        async with console_server(ledger_url, TOKEN) as base, async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = await browser.new_page()
                await page.goto(f"{base}/?token={TOKEN}&name=ada")
                row = page.locator(f'tr[data-run="{started.run_id}"]')
                await expect(row.get_by_test_id("state")).to_have_text("running")
                await row.get_by_role("link").click()
                await expect(page.get_by_test_id("receipt")).to_contain_text(
                    "deploy v2 to production"
                )
                await page.get_by_label("reason").fill("bad build")
                await page.get_by_role("button", name="Cancel run").click()
                receipt = page.get_by_test_id("receipt")
                await expect(receipt).to_contain_text(
                    "Cancellation requested; waiting for vendor confirmation."
                )
                await expect(receipt).to_contain_text("cancelled by console:ada")
                await expect(
                    page.get_by_text("Recorded in the ledger as console:ada")
                ).to_be_visible()

                held.release()  # the provider finishes: the real outcome replaces the wait
                settled = await ledger.wait_settled(started.run_id, timeout=10)
                assert settled.headline is stopline.Headline.STOPPED_WITH_COMPLETED_ACTIONS
                await page.get_by_role("link", name="Follow the run").click()
                await expect(page.get_by_test_id("receipt")).to_contain_text(
                    "Stopped. 1 action had already completed and was kept."
                )
                await expect(page.get_by_test_id("timeline")).to_contain_text(
                    "cancel committed: the fence is raised"
                )
                await page.goto(f"{base}/review")
                await expect(page.get_by_test_id("review")).to_contain_text(
                    "nothing waits for review"
                )
            finally:
                await browser.close()
    assert started.error is None
    run = await ledger.backend.get_run(started.run_id)
    assert run.cancelled_by == "console:ada"
    assert run.cancel_reason == "bad build"
