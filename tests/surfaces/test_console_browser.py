"""The console in a real headless Chromium: see a running run, cancel it, read the receipt."""

from __future__ import annotations

from pathlib import Path

import anyio

import stopline
from stopline import Cancellable
from stopline.ledger.backend import RunSpec
from stopline.testing import FakeProvider
from tests.scenarios.workflows import calls, start
from tests.surfaces.browser import CHROMIUM, CHROMIUM_ARGS, console_server, require_chromium
from tests.surfaces.seed import seed

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
                # accepted, so its provider is not asked to cancel it: no vendor
                # confirmation is awaited, the outcome is (R14)
                await expect(receipt).to_contain_text(
                    "The action may already have happened; verifying before closing this run."
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


async def test_live_refresh_shows_when_stale_and_recovers(
    ledger: stopline.Ledger, ledger_url: str
) -> None:
    require_chromium()
    from playwright.async_api import Route, async_playwright, expect

    await ledger.backend.create_run(
        RunSpec(id="run_live", name="deploy", owner="user:ada", tenant="default")
    )
    async with console_server(ledger_url, TOKEN) as base, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(f"{base}/?token={TOKEN}")
            status = page.get_by_test_id("live-status")
            row = page.locator('tr[data-run="run_live"]')
            await expect(row.get_by_test_id("state")).to_have_text("running")

            async def fail(route: Route) -> None:
                await route.abort("connectionrefused")

            await page.route("**/*partial=1*", fail)  # the console becomes unreachable
            await expect(status).to_have_attribute("data-state", "stale", timeout=10_000)
            await expect(status).to_contain_text("refresh failed")
            await ledger.cancel("run_live", by="user:ada", reason="while the page was stale")
            await page.unroute("**/*partial=1*", fail)  # it is back
            await expect(status).to_have_attribute("data-state", "live", timeout=15_000)
            await expect(row.get_by_test_id("state")).to_have_text("cancelled")
        finally:
            await browser.close()


async def test_the_timeline_picture_and_the_settle_chart(tmp_path: Path) -> None:
    require_chromium()
    from playwright.async_api import async_playwright, expect

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ids = await seed(url)
    async with console_server(url, TOKEN) as base, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            await page.goto(f"{base}/runs/{ids.verified}?token={TOKEN}")
            picture = page.get_by_test_id("timeline-svg")
            await expect(picture).to_be_visible()
            cancel = await picture.locator('[data-mark="cancel"]').bounding_box()
            settled = await picture.locator('[data-mark="settled"]').bounding_box()
            phase = await picture.locator('[data-phase="calling_external"]').bounding_box()
            bar = await picture.locator('rect[data-status="committed"]').bounding_box()
            assert cancel and settled and phase and bar
            assert cancel["x"] < settled["x"]  # the cancel, then the settle, on one time axis
            assert bar["width"] > 0 and phase["width"] > 0
            assert bar["x"] <= cancel["x"]  # the post passed the gate before the cancel

            await page.get_by_role("link", name="Stats").click()
            chart = page.get_by_test_id("settle-chart")
            await expect(chart).to_be_visible()
            await expect(chart.locator('[data-mark="p50"]')).to_have_count(1)
            heights = [
                (await bar.bounding_box() or {"height": 0.0})["height"]
                for bar in await chart.locator("rect[data-count]").all()
            ]
            assert heights and all(h > 0 for h in heights)
            await expect(page.get_by_test_id("stats")).to_contain_text("3 cancelled")
        finally:
            await browser.close()


async def test_a_run_id_with_reserved_characters_opens_from_the_list(tmp_path: Path) -> None:
    require_chromium()
    from playwright.async_api import async_playwright, expect

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    odd = "run_50%?of#these"
    async with stopline.open(url) as ledger:
        await ledger.backend.create_run(
            RunSpec(id=odd, name="odd", owner="user:ada", tenant="default")
        )
    async with console_server(url, TOKEN) as base, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(f"{base}/?token={TOKEN}")
            await page.locator(f'tr[data-run="{odd}"]').get_by_role("link").click()
            await expect(page.locator("h1")).to_contain_text(odd)
            await page.get_by_role("button", name="Cancel run").click()
            await expect(page.get_by_test_id("receipt")).to_contain_text(
                "Canceled before external action."
            )
        finally:
            await browser.close()
