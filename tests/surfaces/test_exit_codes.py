"""Every exit code docs/cli.md documents, each produced by a real command here."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import anyio
from rich.console import Console

from stopline import cli
from stopline.cli.progress import progress
from tests.surfaces.test_cli import _left_running, in_doubt, stopline_cli

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
CONSTANTS = {
    0: cli.EXIT_OK,
    1: cli.EXIT_ERROR,
    2: cli.EXIT_USAGE,
    3: cli.EXIT_PENDING,
    4: cli.EXIT_NEEDS_REVIEW,
    5: cli.EXIT_NOTHING_TO_DO,
}


def documented() -> dict[int, str]:
    table = DOCS.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(m[1]): m[2] for m in re.finditer(r"^\| (\d) \| (.+) \|$", table, re.M)}


def test_the_documented_codes_are_the_cli_constants_and_each_has_a_test() -> None:
    codes = documented()
    assert sorted(codes) == sorted(CONSTANTS)
    assert all(code == value for code, value in CONSTANTS.items())
    tested = {
        int(m[1]) for m in re.finditer(r"^def test_exit_(\d)_", Path(__file__).read_text(), re.M)
    }
    assert tested == set(codes)


def test_exit_0_a_read_that_succeeded_and_a_settled_cancel(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    run_id = anyio.run(_left_running, url, False)
    assert stopline_cli("runs", ledger=url).returncode == cli.EXIT_OK
    assert stopline_cli("cancel", run_id, "--wait", ledger=url).returncode == cli.EXIT_OK


def test_exit_1_an_unknown_run_or_a_bad_ledger(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_left_running, url, False)
    unknown = stopline_cli("show", "run_nope", ledger=url)
    assert unknown.returncode == cli.EXIT_ERROR
    assert unknown.stderr == "stopline: error: unknown run id 'run_nope'\n"
    missing = stopline_cli("runs", ledger=f"sqlite:///{tmp_path / 'nope.db'}")
    assert missing.returncode == cli.EXIT_ERROR and "no ledger file there" in missing.stderr


def test_exit_2_bad_arguments_or_a_missing_extra(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_left_running, url, False)
    bad = stopline_cli("runs", "--since", "3x", ledger=url)
    assert bad.returncode == cli.EXIT_USAGE and "bad age '3x'" in bad.stderr
    for command in ("runs", "stats"):  # a negative LIMIT is none at all on SQLite
        bad = stopline_cli(command, "--limit", "-1", ledger=url)
        assert bad.returncode == cli.EXIT_USAGE, bad.stderr
        assert "Invalid value for '--limit'" in bad.stderr
        huge = stopline_cli(command, "--limit", str(2**64), ledger=url)  # was OverflowError
        assert huge.returncode == cli.EXIT_USAGE, huge.stderr
        assert "limit" in huge.stderr and "Traceback" not in huge.stderr
    # an argument the library refuses (InvalidInput) is a usage error too: it was exit 1,
    # as if the ledger had failed
    for args, says in [
        (("runs", "--owner", ""), "invalid owner: must not be empty"),
        (("cancel", ""), "invalid run_id: must not be empty"),
        # refused before the cancel: it failed once the fence was committed
        (
            ("cancel", "run_x", "--wait", "--timeout", "nan"),
            "invalid --timeout: nan: must be 0 or more seconds",
        ),
    ]:
        bad = stopline_cli(*args, ledger=url)
        assert bad.returncode == cli.EXIT_USAGE, bad.stderr
        assert bad.stderr == f"stopline: usage: {says}\n"
    # odd arguments that were tracebacks: a module name that is empty or relative, a
    # port out of range
    for args in (("map", ""), ("map", ".x"), ("console", "--port", "70000")):
        bad = stopline_cli(*args, ledger=url)
        assert bad.returncode == cli.EXIT_USAGE, bad.stderr
        assert "Traceback" not in bad.stderr and bad.stderr.strip(), args
    # the console extra missing, as on a plain install (jinja2 made unimportable)
    script = "import sys; sys.modules['jinja2'] = None; from stopline.cli import main; "
    script += "sys.exit(main(['console']))"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == cli.EXIT_USAGE, done.stderr
    assert done.stderr == (
        "stopline: this needs the 'console' extra (module 'jinja2' is not installed): "
        "pip install 'stopline[console]'\n"
    )


def test_exit_3_not_settled_yet(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    run_id = anyio.run(_left_running, url, True)
    done = stopline_cli("cancel", run_id, ledger=url)
    assert done.returncode == cli.EXIT_PENDING
    # not declared cancellable: its provider is not asked, no confirmation awaited (R14)
    assert done.stdout.startswith(
        "The action may already have happened; verifying before closing this run."
    )


def test_exit_4_needs_review_with_reconcile_progress(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ids = anyio.run(in_doubt, url, 5)
    terminal = {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}  # as on an operator's terminal
    done = stopline_cli("reconcile", ledger=url, env=terminal)
    assert done.returncode == cli.EXIT_NEEDS_REVIEW, done.stderr
    assert "reconciled 5 operation(s): 5 needs review" in done.stdout
    assert "reconciling" in done.stderr and "5/5" in done.stderr  # the progress bar
    piped = stopline_cli("reconcile", "--json", ledger=url)
    assert piped.stderr == ""  # no bar where nobody watches, stdout stays JSON
    assert len(ids) == 5


def test_exit_5_resume_with_nothing_to_resume(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    run_id = anyio.run(_left_running, url, False)
    done = stopline_cli("resume", run_id, ledger=url)
    assert done.returncode == cli.EXIT_NOTHING_TO_DO
    assert done.stdout == f"nothing to resume: run {run_id} is running\n"
    as_json = stopline_cli("resume", run_id, "--json", ledger=url)
    assert as_json.returncode == cli.EXIT_NOTHING_TO_DO
    assert '"resumed": false' in as_json.stdout


def test_the_progress_helper_draws_only_on_an_interactive_terminal() -> None:
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, force_interactive=True, width=80)
    with progress("checking", total=3, console=terminal) as bar:
        assert bar.drawn
        bar.advance()
        bar.update(3)
        bar.describe("checked")
    assert "checked" in screen.getvalue() and "3/3" in screen.getvalue()
    log = io.StringIO()
    with progress("checking", total=3, console=Console(file=log)) as bar:
        assert not bar.drawn
        bar.advance()
    assert log.getvalue() == ""
