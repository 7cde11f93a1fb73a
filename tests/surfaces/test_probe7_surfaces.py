"""Probe 7 of the operator surfaces: what ``stopline runs``, ``show`` and the console say
of who holds a run that has not ended.

Before, ``stopline runs`` listed a run whose call a live worker holds, one whose worker
was killed mid-call (left for the next open's recovery), one left to its owners by
another run's cancel (R6) and one nobody ever entered alike: ``running``, headline
``running``. The ledger records the worker that passed each call's gate with its
lease, and the owners a run was left to; the surfaces now say which (``HELD BY``).
"""

from __future__ import annotations

import contextlib
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from stopline.cli import EXIT_USAGE
from stopline.ledger.backend import RunSpec
from tests.lifecycle.test_shared_child_r6_nested_block import _a_cancelled_around_s
from tests.surfaces.browser import CHROMIUM, CHROMIUM_ARGS, console_server, require_chromium
from tests.surfaces.test_cli import as_json, stopline_cli

pytestmark = pytest.mark.timeout(120)

TOKEN = "probe7-token"

# a worker process: opens the ledger, enters the run, holds one call in flight (its
# tool writes the flag file, then waits for ever) until it is killed
_WORKER = """
import sys
from pathlib import Path
import anyio
import stopline

async def main(url, run_id, flag):
    @stopline.tool
    async def charge(ctx: stopline.CallContext, amount: int) -> str:
        Path(flag).write_text(ctx.key)
        await anyio.sleep_forever()
        return "never"

    async with stopline.open(url) as ledger:
        async with ledger.run("checkout", owner="user:w", run_id=run_id) as run:
            await run.call(charge, 1, key="charge")

anyio.run(main, *sys.argv[1:4])
"""


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def hold_a_call(url: str, run_id: str, flag: Path) -> subprocess.Popen[bytes]:
    """A worker process with ``run_id``'s call in flight, once its tool has run."""
    process = subprocess.Popen([sys.executable, "-c", _WORKER, url, run_id, str(flag)])
    deadline = time.monotonic() + 60
    while not flag.exists():  # a barrier: the tool wrote it, the call passed the gate
        assert process.poll() is None, "the worker ended before its call"
        assert time.monotonic() < deadline, "the worker's call never started"
        time.sleep(0.05)
    return process


def held_by(url: str, run_id: str) -> Any:
    """``stopline runs --json``'s ``held_by`` of the run."""
    rows = as_json(stopline_cli("runs", "--json", ledger=url))
    (row,) = [row for row in rows if row["id"] == run_id]
    return row["held_by"]


def table_cell(url: str, run_id: str) -> str:
    """The ``HELD BY`` cell of the run's row in ``stopline runs``."""
    done = stopline_cli("runs", ledger=url)
    assert done.returncode == 0, done.stderr
    header, *lines = done.stdout.splitlines()
    start, end = header.index("HELD BY"), header.index("HEADLINE")
    (line,) = [ln for ln in lines if ln.split()[0] == run_id]
    return line[start:end].strip()


def ledger_bytes(url: str) -> bytes:
    return Path(url.removeprefix("sqlite:///")).read_bytes()


@pytest.mark.parametrize("ledger_backend", ["sqlite", "postgres"], indirect=True)
def test_runs_tells_a_live_worker_from_one_gone(
    ledger_url: str, tmp_path: Path, worker: list[subprocess.Popen[bytes]]
) -> None:
    """A call held by a live worker is ``live``, with its pid; once that worker is killed
    mid-call the same run is ``gone: left for recovery``; the listing changes nothing
    (the call is still in flight in the ledger, for the next open to recover)."""

    async def create() -> None:
        async with stopline.open(ledger_url):
            pass

    anyio.run(create)
    process = hold_a_call(ledger_url, "run_held", tmp_path / "flag")
    worker.append(process)
    held = held_by(ledger_url, "run_held")
    (live,) = held["workers"]
    assert (live["pid"], live["seen"], live["left_for_recovery"]) == (process.pid, "live", False)
    assert live["calls_in_flight"] == 1
    assert table_cell(ledger_url, "run_held") == f"pid {process.pid}@{live['host']}, live"

    process.send_signal(signal.SIGKILL)
    process.wait()
    before = ledger_bytes(ledger_url) if ledger_url.startswith("sqlite") else b""
    (gone,) = held_by(ledger_url, "run_held")["workers"]
    assert (gone["pid"], gone["seen"], gone["left_for_recovery"]) == (process.pid, "gone", True)
    cell = table_cell(ledger_url, "run_held")
    assert cell == f"pid {process.pid}@{gone['host']}, gone: left for recovery"
    shown = stopline_cli("show", "run_held", ledger=ledger_url)
    assert f"held by: {cell}" in shown.stdout.splitlines()
    if before:  # a read: the file is as it was, the call still in flight
        assert ledger_bytes(ledger_url) == before


def test_runs_marks_a_run_left_to_its_owners(tmp_path: Path) -> None:
    """``A``'s cancel cut shared ``S``'s block, which ``B`` holds (R6): ``S`` is
    ``running``, left to ``B``; once ``B`` completes without going on with it, the
    listing says so (``B (completed)``): nobody is left to go on with it."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"

    async def left() -> None:
        async with stopline.open(url) as ledger, ledger.run("b", owner="u", run_id="B") as b:
            assert await _a_cancelled_around_s(ledger, b.id) == ["interrupted"]
            shown = await anyio.to_thread.run_sync(held_by, url, "S")
            assert shown["left_to_owners"] == [{"run": "B", "state": "running"}]
            assert shown["cut_by"] == "A"
            cell = await anyio.to_thread.run_sync(table_cell, url, "S")
            assert cell == "left to owners B"

    anyio.run(left)
    shown = held_by(url, "S")
    assert shown == {
        "workers": [],
        "left_to_owners": [{"run": "B", "state": "completed"}],
        "cut_by": "A",
    }
    assert table_cell(url, "S") == "left to owners B (completed)"
    assert held_by(url, "A") is None  # ended: nothing holds it
    assert as_json(stopline_cli("show", "S", "--json", ledger=url))["held_by"] == shown


def test_a_run_between_calls_is_said_to_have_none_in_flight(tmp_path: Path) -> None:
    """A run with no call in flight: the ledger records no process holding it, and the
    listing says only that (not ``live``, not ``gone``)."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"

    async def between_calls() -> None:
        async with stopline.open(url) as ledger:
            await ledger.backend.create_run(
                RunSpec(id="run_idle", name="idle", owner="u", tenant="default")
            )

    anyio.run(between_calls)
    assert held_by(url, "run_idle") == {"workers": [], "left_to_owners": [], "cut_by": None}
    assert table_cell(url, "run_idle") == "no call in flight"


def dump(url: str) -> list[str]:
    """Every row of the SQLite ledger, as SQL: what "unchanged" compares."""
    with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
        return list(db.iterdump())


@pytest.mark.parametrize(
    "command",
    [
        ("cancel", "run_1"),
        ("pause", "run_1"),
        ("resume", "run_1"),
        ("review", "resolve", "run_1/charge", "--as", "committed"),
    ],
    ids=["cancel", "pause", "resume", "review-resolve"],
)
@pytest.mark.parametrize("via", ["--by", "$STOPLINE_PRINCIPAL"])
def test_acting_as_stopline_itself_is_a_usage_error_and_writes_nothing(
    tmp_path: Path, command: tuple[str, ...], via: str
) -> None:
    """``--by stopline`` (or ``$STOPLINE_PRINCIPAL=stopline``) names stopline's own
    principal, which the access policy lets nobody act as. It was refused as ``unknown
    run id 'run_1'`` (exit 1) of a run that exists, after a ``denied`` event was written
    to the ledger; now it is a usage error naming ``by``, before the ledger is opened."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"

    async def in_review() -> None:
        async with stopline.open(url, verify=stopline.VerifyBudget(attempts=1)) as ledger:

            @stopline.tool
            async def charge(ctx: stopline.CallContext) -> str:
                raise ConnectionResetError("no answer")

            async with ledger.run("checkout", owner="u", run_id="run_1") as run:
                with pytest.raises(ConnectionResetError):
                    await run.call(charge, key="charge")

    anyio.run(in_review)
    before = dump(url)
    args, env = (
        ((*command, "--by", "stopline"), {})
        if via == "--by"
        else (command, {"STOPLINE_PRINCIPAL": "stopline"})
    )
    done = stopline_cli(*args, ledger=url, env=env)
    assert done.returncode == EXIT_USAGE, (done.stdout, done.stderr)
    assert done.stderr.strip() == (
        "stopline: usage: invalid by: 'stopline' is stopline's own principal: no one acts as it"
    )
    assert "unknown run" not in done.stderr
    assert dump(url) == before


OWNER = 'B<img src=x onerror="window.pwned=1">'  # a run id may hold markup: it is text


async def test_the_console_shows_who_holds_each_run_as_text(
    tmp_path: Path, worker: list[subprocess.Popen[bytes]]
) -> None:
    """In a real Chromium: the runs page's ``Held by`` cell of a run left to an owner whose
    id holds markup reads as that id (no element made, no script run), a call a live
    worker holds reads ``live`` with its pid, and the run page says the same."""
    require_chromium()
    from playwright.async_api import async_playwright, expect

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with stopline.open(url) as ledger, ledger.run("b", owner="u", run_id=OWNER) as b:
        assert await _a_cancelled_around_s(ledger, b.id) == ["interrupted"]
    process = await anyio.to_thread.run_sync(hold_a_call, url, "run_held", tmp_path / "flag")
    worker.append(process)
    async with console_server(url, TOKEN) as base, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(f"{base}/?token={TOKEN}&name=ada")
            left = page.locator('tr[data-run="S"]').get_by_test_id("held")
            await expect(left).to_have_text(f"left to owners {OWNER} (completed)")
            assert await left.locator("img").count() == 0
            held = page.locator('tr[data-run="run_held"]').get_by_test_id("held")
            await expect(held).to_have_text(re.compile(rf"^pid {process.pid}@\S+, live$"))
            await page.goto(f"{base}/runs/S")
            await expect(page.get_by_test_id("held")).to_have_text(
                f"left to owners {OWNER} (completed)"
            )
            assert await page.evaluate("window.pwned") is None
        finally:
            await browser.close()
