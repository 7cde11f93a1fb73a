"""ADR 0070: the console shows stored text as stored. A bidirectional control in a
run's name, a description, a reason or a note is drawn by name, and each stored
value is isolated, so neither reorders what a reader sees (in a real Chromium)."""

from __future__ import annotations

import html
import re
from pathlib import Path

import anyio
import pytest
from starlette.testclient import TestClient

import stopline
from stopline import Cancellable, PhaseKind, Policy
from stopline.console import ConsoleConfig, create_app
from stopline.domain.lifecycle import operator
from stopline.runtime.review import ReviewVerdict
from stopline.testing import FakeProvider
from tests.surfaces.browser import CHROMIUM, CHROMIUM_ARGS, console_server, require_chromium

pytestmark = pytest.mark.timeout(120)

TOKEN = "t0ken-for-bidi"
RLO, PDF, RLI, PDI, RLM = "\u202e", "\u202c", "\u2067", "\u2069", "\u200f"
# stored: "refund 0001 EUR" with the digits overridden right to left: reads "1000 EUR"
REFUND = f"refund {RLO}0001{PDF} EUR"
REASON = f"customer asked {RLI}twice{PDI} {RLM}"
NOTE = f"checked the bank: {RLO}txn 42{PDF}"
# Unicode's Bidi_Control property
BIDI_CONTROLS = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
HEBREW = "שלום"  # a run's name in right-to-left script: legitimate, and isolated
RUN_ID = "7f3a-run"  # the id beside it starts with a digit, which such a name pulls over


async def left_in_review(
    ledger: stopline.Ledger, name: str, description: str, *, run_id: str | None = None
) -> str:
    """A run whose one call committed, unverifiable, cancelled at that moment: in review."""
    pay = FakeProvider(
        "refund",
        cancellable=Cancellable.NEVER,
        verifiable=False,
        description=description,
    )
    held = pay.hold("committed")
    ids: list[str] = []
    started = anyio.Event()

    async def body() -> None:
        async with ledger.run(name, owner="user:ada", run_id=run_id) as run:
            ids.append(run.id)
            started.set()
            async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
                await run.call(pay.tool, "payload")

    async with anyio.create_task_group() as tg:
        tg.start_soon(body)
        await started.wait()
        await held.reached.wait()
        await ledger.cancel(ids[0], by="user:ada", reason=REASON)
        held.release()
    await ledger.wait_settled(ids[0], timeout=10)
    return ids[0]


async def seeded(url: str) -> tuple[str, str]:
    """A run in review (``REFUND``), and one decided with ``NOTE`` as its evidence."""
    async with stopline.open(url) as ledger:
        waiting = await left_in_review(ledger, HEBREW, REFUND, run_id=RUN_ID)
        decided = await left_in_review(ledger, f"deploy {RLO}prod", REFUND)
        op = next(i.op for i in await ledger.review_items() if i.run.id == decided)
        await ledger.resolve_review(
            op.id, ReviewVerdict.COMMITTED, by=operator("user:bob"), note=NOTE
        )
    return waiting, decided


def test_no_page_carries_a_bidirectional_control(tmp_path: Path) -> None:
    """Every page (text, attributes, <title>, the SVG picture): each control by name."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    waiting, decided = anyio.run(seeded, url)
    client = TestClient(
        create_app(ConsoleConfig(url=url, token=TOKEN)), base_url="http://127.0.0.1"
    )
    with client:
        client.get(f"/?token={TOKEN}&name=ada")
        pages = {
            path: client.get(path).text
            for path in ("/", "/review", "/stats", f"/runs/{waiting}", f"/runs/{decided}")
        }
    for path, page in pages.items():
        assert BIDI_CONTROLS.search(page) is None, path
    text = {path: html.unescape(re.sub("<[^>]*>", "", page)) for path, page in pages.items()}
    assert "refund <U+202E>0001<U+202C> EUR" in text["/review"]
    assert (
        '<span class="ctl" title="right-to-left override">&lt;U+202E&gt;</span>'
        in (pages["/review"])
    )
    assert "<U+2067>twice<U+2069> <U+200F>" in text[f"/runs/{waiting}"]  # the reason
    assert "checked the bank: <U+202E>txn 42<U+202C>" in text[f"/runs/{decided}"]  # evidence
    assert "<title>deploy &lt;U+202E&gt;prod" in pages[f"/runs/{decided}"]  # no <bdi> there


# In the page: the left edge of each character of the first text node holding ``part``
# under the element, in stored order (one Range per character).
_XS = """([root, part]) => {
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const at = node.data.indexOf(part);
    if (at < 0) continue;
    const xs = [];
    for (let i = at; i < at + part.length; i++) {
      const range = document.createRange();
      range.setStart(node, i);
      range.setEnd(node, i + 1);
      xs.push(range.getBoundingClientRect().left);
    }
    return xs;
  }
  return null;
}"""

# every text node holding ``part`` (outside the SVG picture and <title>) sits in a <bdi>
_ISOLATED = """([part]) => {
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const loose = [];
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const el = node.parentElement;
    if (!node.data.includes(part) || el.closest("svg, script")) continue;
    if (!el.closest("bdi")) loose.push(el.outerHTML);
  }
  return loose;
}"""


async def test_a_cell_reads_in_stored_order_and_moves_no_neighbour(tmp_path: Path) -> None:
    require_chromium()
    from playwright.async_api import async_playwright, expect

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    waiting, decided = await seeded(url)
    async with console_server(url, TOKEN) as base, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            await page.goto(f"{base}/review?token={TOKEN}")
            row = page.locator(f'tr[data-op] >> text="{RUN_ID}"').locator("xpath=ancestor::tr")
            what = row.locator("td").first.locator("b")
            digits = await page.evaluate(_XS, [await what.element_handle(), "0001"])
            assert digits is not None and digits == sorted(digits), digits  # not "1000"
            await expect(what).to_have_text("refund <U+202E>0001<U+202C> EUR")
            assert await page.evaluate(_ISOLATED, ["refund"]) == []

            await page.goto(f"{base}/runs/{waiting}")
            title = page.locator("h1")
            name = await page.evaluate(_XS, [await title.element_handle(), HEBREW])
            run_id = await page.evaluate(_XS, [await title.element_handle(), RUN_ID])
            assert name and run_id
            # the id's first digit stays right of the name, not pulled before it
            assert run_id[0] > max(name), (name, run_id)
            receipt = page.get_by_test_id("receipt")
            await expect(receipt).to_contain_text("“customer asked <U+2067>twice<U+2069> <U+200F>”")
            for part in ("customer asked", HEBREW, RUN_ID):
                assert await page.evaluate(_ISOLATED, [part]) == [], part

            await page.goto(f"{base}/runs/{decided}")
            evidence = page.get_by_test_id("receipt").locator("div.mono")
            await expect(evidence).to_contain_text(
                "(committed: checked the bank: <U+202E>txn 42<U+202C>)"
            )
            txn = await page.evaluate(_XS, [await evidence.element_handle(), "txn 42"])
            assert txn is not None and txn == sorted(txn), txn
            assert await page.evaluate(_ISOLATED, ["checked the bank"]) == []
        finally:
            await browser.close()
