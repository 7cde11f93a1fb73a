"""Screenshots of the console's main pages for docs/console.md.

    .venv/bin/python scripts/screenshots.py      # writes docs/images/console-*.png

Builds a throw-away ledger with one run of each kind (tests/surfaces/seed.py),
serves the console on 127.0.0.1 and photographs it with Debian's headless
Chromium (``make browser`` installs it).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.surfaces.browser import (  # noqa: E402
    CHROMIUM,
    CHROMIUM_ARGS,
    chromium_missing,
    console_server,
)
from tests.surfaces.seed import seed  # noqa: E402

OUT = ROOT / "docs" / "images"
TOKEN = "screenshots"


async def main() -> int:
    missing = chromium_missing()
    if missing:
        sys.stderr.write(missing + "\n")
        return 1
    from playwright.async_api import async_playwright

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'ledger.db'}"
        ids = await seed(url)
        async with console_server(url, TOKEN) as base, async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = await browser.new_page(viewport={"width": 1280, "height": 760})
            await page.goto(f"{base}/?token={TOKEN}&name=ada")
            shots = [
                ("console-runs.png", "/"),
                ("console-run.png", f"/runs/{ids.verified}"),
                ("console-review.png", "/review"),
                ("console-stats.png", "/stats"),
            ]
            for name, path in shots:
                await page.goto(base + path)
                await page.screenshot(path=str(OUT / name), full_page=True)
                sys.stderr.write(f"wrote {OUT / name}\n")
            await browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main))
