"""The review queue follows the ledger as the runs page does (one live mechanism): an
item another process leaves in review appears, one decided elsewhere goes, a note
being typed stays (in a real Chromium)."""

from __future__ import annotations

from pathlib import Path

import pytest

import stopline
from stopline.domain.lifecycle import operator
from stopline.runtime.review import ReviewVerdict
from tests.surfaces.browser import CHROMIUM, CHROMIUM_ARGS, console_server, require_chromium
from tests.surfaces.test_console_edges_bidi import left_in_review

pytestmark = pytest.mark.timeout(120)

TOKEN = "t0ken-for-review"
FOLLOWED = 15_000  # ms: a few refreshes of the page's own, never a reload


async def test_the_review_queue_follows_other_processes(tmp_path: Path) -> None:
    require_chromium()
    from playwright.async_api import async_playwright, expect

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with stopline.open(url) as other:
        first = await left_in_review(other, "checkout", "charge card 4242 for 120 EUR")
    async with console_server(url, TOKEN) as base, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(f"{base}/review?token={TOKEN}&name=ada")
            rows = page.get_by_test_id("review").locator("tbody tr")
            await expect(rows).to_have_count(1)
            await expect(rows.first).to_contain_text(first)
            await page.evaluate("window.sameDocument = true")  # gone if the page reloads
            note = rows.first.get_by_label("note")
            await note.fill("checked the bank: half done")
            await note.blur()  # a field with focus holds the refresh back: this one has none

            async with stopline.open(url) as other:  # another process's ledger
                second = await left_in_review(other, "refund", "refund 30 EUR")
                await expect(page.locator("tbody tr", has_text=second)).to_have_count(
                    1, timeout=FOLLOWED
                )
                # the typed note outlived the refresh that brought the new item
                await expect(
                    page.locator("tbody tr", has_text=first).get_by_label("note")
                ).to_have_value("checked the bank: half done")

                op = next(i.op for i in await other.review_items() if i.run.id == first)
                await other.resolve_review(
                    op.id, ReviewVerdict.COMMITTED, by=operator("user:bob"), note="seen"
                )
                await expect(page.locator("tbody tr", has_text=first)).to_have_count(
                    0, timeout=FOLLOWED
                )
            await expect(rows).to_have_count(1)
            await expect(page.get_by_test_id("live-status")).to_have_attribute("data-state", "live")
            assert await page.evaluate("window.sameDocument") is True
        finally:
            await browser.close()
