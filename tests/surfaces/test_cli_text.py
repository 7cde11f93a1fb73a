"""What the ledger holds, printed as it is: no markup read, no terminal control, and
stats counting each run under the headline its own receipt gives."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import anyio
import pytest
from starlette.testclient import TestClient

import stopline
from stopline.cli import EXIT_OK
from stopline.console import ConsoleConfig, create_app
from stopline.domain.lifecycle import operator
from stopline.domain.limits import BIDI_CONTROLS
from tests.surfaces.test_cli import as_json, stopline_cli

MARKED = "run_[red]1"  # valid rich style tags: they were eaten, and `run_1` listed
NAME, OWNER, BY = "deploy [prod]", "user:[bold]ada", "ops:[red]kim"
REASON = "see ticket [/ops/123] :thumbs_up:"  # a closing tag that matches nothing
DESCRIPTION = "post to [/partner] inbox"
ERROR = "peer reset [/]"
# what a terminal obeys: retitle the window, clear the screen, colour the rest red
ESCAPES = "\x1b]0;PWNED\x07\x1b[2J\x1b[31mRED\x1b[0m"
WIDE = {"COLUMNS": "400"}  # no cell folded across lines


@stopline.tool(name="post[/x]", description=DESCRIPTION)
async def post(ctx: stopline.CallContext) -> str:
    raise ConnectionResetError(ERROR)  # no answer and no verifier: human review


@stopline.tool(name="boom", description="boom")
async def boom(ctx: stopline.CallContext) -> str:
    raise ValueError(f"bad {ESCAPES}")


async def _odd_ledger(url: str) -> None:
    async with stopline.open(url) as ledger:
        async with ledger.run(NAME, owner=OWNER, run_id=MARKED) as run:
            await ledger.cancel(run.id, by=operator(BY), reason=REASON)
        with pytest.raises(Exception):  # noqa: B017,PT011 (however the run ends)
            async with ledger.run("review", owner="user:rev", run_id="run_rv") as run:
                await run.call(post)
        await ledger.reconcile()


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('text') / 'ledger.db'}"
    anyio.run(_odd_ledger, url)
    return url


def test_a_listed_run_id_is_the_run_id(odd: str) -> None:
    """A run id, name or owner holding a valid style tag (`run_[red]1`) was listed
    without it (`run_1`), and the listed id was unknown to `show`."""
    listed = stopline_cli("runs", ledger=odd, env=WIDE)
    assert listed.returncode == EXIT_OK, listed.stderr
    ids = [line.split()[0] for line in listed.stdout.splitlines()[1:]]
    assert sorted(ids) == sorted(
        run["id"] for run in as_json(stopline_cli("runs", "--json", ledger=odd))
    )
    assert MARKED in ids and NAME in listed.stdout and OWNER in listed.stdout
    assert stopline_cli("show", MARKED, "--json", ledger=odd).returncode == EXIT_OK


def test_text_with_square_brackets_prints_as_the_ledger_holds_it(odd: str) -> None:
    """`show`, `review list`, `review show` (and `runs`, for a name or an id) raised
    MarkupError on a `[/...]` in a reason, a description or an error."""
    shown = stopline_cli("show", MARKED, ledger=odd, env=WIDE)
    assert shown.returncode == EXIT_OK, shown.stderr
    assert f"{NAME} {MARKED}  owner {OWNER}" in shown.stdout
    assert f"cancelled by {BY} ({REASON})" in shown.stdout
    assert f"run {MARKED}: cancelled, settled" in shown.stdout
    review = stopline_cli("review", "list", ledger=odd, env=WIDE)
    assert review.returncode == EXIT_OK, review.stderr
    assert DESCRIPTION in review.stdout
    (item,) = as_json(stopline_cli("review", "list", "--json", ledger=odd))
    op = stopline_cli("review", "show", item["operation"]["id"], ledger=odd, env=WIDE)
    assert op.returncode == EXIT_OK, op.stderr
    assert f"{DESCRIPTION} {item['operation']['id']}" in op.stdout
    assert ERROR in op.stdout
    again = stopline_cli("cancel", MARKED, "--by", BY, ledger=odd, env=WIDE)
    assert again.returncode == EXIT_OK, again.stderr
    assert f"cancelled by {BY} ({REASON})" in again.stdout
    assert f"run {MARKED}: cancelled, settled" in again.stdout


def test_map_prints_a_tool_name_with_square_brackets(tmp_path: Path) -> None:
    module = tmp_path / "odd_tools.py"
    module.write_text(
        "from stopline import Tool\n\n"
        "async def _send(x: str) -> str:\n"
        "    return x\n\n"
        f"odd = Tool(_send, name='post[/x]', description={DESCRIPTION!r})\n"
    )
    done = stopline_cli("map", str(module), env=WIDE)
    assert done.returncode == EXIT_OK, done.stderr
    assert "post[/x]" in done.stdout
    assert "  post[/x]: no verifier" in done.stdout


async def _escapes_ledger(url: str) -> None:
    """A run failed by an exception whose message holds escape codes (its `fail` event
    keeps them; the call's outcome, unknown without a verifier, waits for review)."""
    async with stopline.open(url) as ledger:
        with pytest.raises(ValueError, match="bad"):
            async with ledger.run("ansi", owner="user:x", run_id="run_ansi") as run:
                await run.call(boom)
        await ledger.reconcile()
        async with ledger.run("cancelled", owner="user:x", run_id="run_c") as run:
            await ledger.cancel(run.id, by=operator("ops:kim"), reason="stop")


def _aged(path: Path) -> None:
    """As a stopline that stored text raw left a ledger: escapes in runs' names and
    cancel reasons, and in operations' descriptions and errors."""
    with sqlite3.connect(path) as db:
        db.execute("UPDATE runs SET name = ?, cancel_reason = ?", (f"n{ESCAPES}", ESCAPES))
        db.execute("UPDATE operations SET description = ?, error = ?", (ESCAPES, ESCAPES))


def test_no_stored_text_reaches_the_terminal_as_control_characters(tmp_path: Path) -> None:
    """An exception's escape codes, stored raw in a run's `fail` event (and, by an older
    stopline, in names, reasons, descriptions and errors), drove the terminal."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    anyio.run(_escapes_ledger, url)
    _aged(path)
    (item,) = as_json(stopline_cli("review", "list", "--json", ledger=url))
    assert item["operation"]["error"] == ESCAPES  # the ledger holds them as they were
    for args in (
        ("runs",),
        ("show", "run_ansi"),
        ("show", "run_c"),
        ("review", "list"),
        ("review", "show", item["operation"]["id"]),
    ):
        done = stopline_cli(*args, ledger=url, env=WIDE)
        assert done.returncode == EXIT_OK, (args, done.stderr)
        printed = done.stdout + done.stderr
        assert "\x1b" not in printed and "\x07" not in printed, args
        assert "\ufffd]0;PWNED\ufffd\ufffd[2J" in printed, args  # replaced, not dropped


async def _parent_and_child(url: str) -> None:
    """A parent run whose exclusively owned child committed an action, then cancelled."""

    @stopline.tool(description="wire money")
    async def wire(ctx: stopline.CallContext) -> str:
        return ctx.key

    async with stopline.open(url) as ledger:
        async with ledger.run("parent", owner="user:p", run_id="run_P") as run:
            async with run.child("child", run_id="run_C") as child:
                await child.call(wire)
            await ledger.cancel("run_P", by=operator("ops:kim"), reason="stop")
        await ledger.wait_settled("run_P", timeout=10)


def test_stats_counts_each_run_under_its_own_receipts_headline(tmp_path: Path) -> None:
    """`stats` (and the console's /stats) counted the parent as cancelled before any
    external action while its receipt said a completed action was kept."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_parent_and_child, url)
    shown = as_json(stopline_cli("show", "run_P", "--json", ledger=url))
    assert shown["receipt"]["headline"] == "stopped_with_completed_actions"
    listed = as_json(stopline_cli("runs", "--json", ledger=url))
    by_receipt: dict[str, int] = {}
    for run in listed:
        by_receipt[run["headline"]] = by_receipt.get(run["headline"], 0) + 1
    stats = as_json(stopline_cli("stats", "--json", ledger=url))
    assert stats["outcomes"] == by_receipt == {"completed": 1, "stopped_with_completed_actions": 1}
    token = "t0ken"
    with TestClient(
        create_app(ConsoleConfig(url=url, token=token)), base_url="http://127.0.0.1"
    ) as client:
        page = client.get(f"/stats?token={token}")
    assert page.status_code == 200
    outcomes = page.text.split('data-testid="outcomes"', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr><td>(\w+)</td><td>(\d+)</td></tr>", outcomes)
    assert {headline: int(n) for headline, n in rows} == by_receipt


async def _bidi_ledger(url: str) -> None:
    @stopline.tool(description="refund \u202e0001\u202c EUR")
    async def refund(ctx: stopline.CallContext) -> str:
        return "refunded"

    async with (
        stopline.open(url) as ledger,
        ledger.run("pay \u2067back\u2069", owner="user:1", run_id="run_bidi") as run,
    ):
        await run.call(refund)


def test_a_bidirectional_control_prints_as_its_code_point(tmp_path: Path) -> None:
    """A stored U+202E made the terminal draw "refund 0001 EUR" as "refund 1000 EUR", as
    the console did (ADR 0070): each is printed as its code point; JSON keeps the text."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_bidi_ledger, url)
    for args in (("runs",), ("show", "run_bidi")):
        done = stopline_cli(*args, ledger=url, env=WIDE)
        assert done.returncode == EXIT_OK, (args, done.stderr)
        printed = done.stdout + done.stderr
        assert not BIDI_CONTROLS.search(printed), args
        assert "<U+2067>back<U+2069>" in printed, args
        if args[0] == "show":
            assert "refund <U+202E>0001<U+202C> EUR" in printed
    shown = as_json(stopline_cli("show", "run_bidi", "--json", ledger=url))
    assert shown["run"]["name"] == "pay \u2067back\u2069"  # the data as stored
