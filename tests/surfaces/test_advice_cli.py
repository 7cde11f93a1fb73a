"""ADR 0066: every recovery step the CLI prints is a command a shell user runs as printed,
and following the line, command by command, on a real ledger file repeats nothing.

The receipt's recovery line named library calls (``ledger.resume(run_id, by=...)``,
``ledger.wait_settled``) in ``stopline show``, ``cancel`` and ``pause``, and a
refused ``stopline resume`` answered with ``ledger.review_items`` and
``ledger.resolve_review``. Each is said now as the CLI's command, quoted as typed.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from stopline.cli import EXIT_ERROR, EXIT_NEEDS_REVIEW, EXIT_OK
from stopline.domain.vocab import OpStatus
from tests.surfaces.test_cli import _left_running, as_json, stopline_cli

pytestmark = pytest.mark.timeout(120)

COMMAND = re.compile(r"`(stopline [^`]*)`")


def recovery(done: subprocess.CompletedProcess[str]) -> str:
    """The receipt's recovery line as the CLI printed it."""
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("  resume: ")]
    return line.removeprefix("  resume: ")


def follow(command: str, url: str) -> subprocess.CompletedProcess[str]:
    """Run a command exactly as the line printed it (against the same ledger)."""
    argv = shlex.split(command)
    assert argv[0] == "stopline"
    return stopline_cli(*argv[1:], ledger=url)


async def lost_answer(url: str, run_id: str, sent: list[str]) -> None:
    """A run whose call lost its answer, with no read-back: cancelled, it goes to review."""

    @stopline.tool
    async def charge(ctx: stopline.CallContext, amount: int) -> str:
        sent.append(ctx.key)
        if len(sent) == 1:
            raise ConnectionResetError("dropped before any answer")
        return "charged"

    async with stopline.open(url, verify=stopline.VerifyBudget(attempts=1)) as ledger:
        async with ledger.run("checkout", owner="user:1", run_id=run_id) as run:
            with pytest.raises(ConnectionResetError):
                await run.call(charge, 120, key="charge")
            await ledger.cancel(run.id, by="user:1")
        await ledger.wait_settled(run_id, timeout=30)


async def reenter(url: str, run_id: str, sent: list[str]) -> None:
    @stopline.tool
    async def charge(ctx: stopline.CallContext, amount: int) -> str:
        sent.append(ctx.key)
        return "charged"

    async with (
        stopline.open(url) as ledger,
        ledger.run("checkout", owner="user:1", run_id=run_id) as run,
    ):
        await run.call(charge, 120, key="charge")


def test_following_the_cli_line_through_review_and_resume(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    sent: list[str] = []
    anyio.run(lost_answer, url, "r-review", sent)

    # in review: the reviewer's commands, for that operation
    shown = stopline_cli("show", "r-review", ledger=url)
    line = recovery(shown)
    assert "ledger." not in line
    assert line.startswith("a reviewer decides 1 operation in review")
    assert COMMAND.findall(line) == [
        "stopline review show r-review/charge",
        "stopline review resolve r-review/charge --as committed",
        "stopline review resolve r-review/charge --as not_committed",
    ]
    # a resume now is refused, and says so in commands too
    assert refused_resume(url, "r-review") == [
        "stopline review list",
        "stopline review resolve OP --as committed",
        "stopline resume r-review",
    ]
    assert follow("stopline review list", url).returncode == EXIT_OK
    for command in COMMAND.findall(line)[:1]:
        done = follow(command, url)
        assert done.returncode == EXIT_OK, done.stderr
        assert "needs_review" in done.stdout
        # what the record holds, not a claim of what the provider can do
        assert "cancel ability on record: never" in done.stdout
    # the reviewer finds it did not happen (the second decision the line names)
    decided = follow(COMMAND.findall(line)[2], url)
    assert decided.returncode == EXIT_OK, decided.stderr
    # the receipt it prints says the next step as a command too (it said ledger.resume)
    assert "ledger." not in decided.stdout
    assert "`stopline resume r-review`" in decided.stdout

    # settled: the line says what a resume sends again, and the command to resume
    line = recovery(stopline_cli("show", "r-review", ledger=url))
    assert "ledger." not in line
    assert COMMAND.findall(line) == ["stopline resume r-review"]
    assert "then re-enter the run from your application with the same run id" in line
    assert (
        "0 completed actions are returned from the ledger, not repeated; 1 action that "
        "never happened is sent when the workflow reaches it, with the same key "
        "('r-review/charge')" in line
    )
    resumed = follow("stopline resume r-review", url)
    assert resumed.returncode == EXIT_OK, resumed.stderr
    anyio.run(reenter, url, "r-review", sent)
    assert sent == ["r-review/charge", "r-review/charge"]  # the lost one, then its retry


async def left_settling(url: str) -> str:
    """A run cancelled while a call of a worker that is gone was in flight."""
    run_id = await _left_running(url, with_operation=True)
    async with stopline.open(url) as ledger:
        await ledger.cancel(run_id, by="user:cyd")  # its owner
    return run_id


def long_ago(url: str) -> None:
    """The gone worker's calls last moved an hour ago. It never registered, so it is
    taken for dead once its calls have not moved for a lease period (30 s): the test
    waited that out in full before the open could recover its call."""
    path = url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("UPDATE operations SET updated_at = updated_at - 3600")


def refused_resume(url: str, run_id: str) -> list[str]:
    """``stopline resume`` of a run that cannot resume yet: the commands it names."""
    refused = stopline_cli("resume", run_id, ledger=url)
    assert refused.returncode == EXIT_ERROR
    assert "ledger." not in refused.stderr
    assert "re-enter the run from your application with the same run id" in refused.stderr
    return COMMAND.findall(refused.stderr)


def test_the_wait_the_cli_names_is_a_command_that_waits(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    run_id = anyio.run(left_settling, url)
    shown = stopline_cli("show", run_id, "--json", ledger=url)
    receipt: dict[str, Any] = as_json(shown)["receipt"]
    line = receipt["resume_rule"]
    assert line.startswith(f"wait until it settles (`stopline cancel {run_id} --wait` waits for it")
    assert "ledger." not in line
    # the structured form: what to do, for which run
    assert receipt["advice"]["steps"] == [{"do": "wait", "run_id": run_id, "op_ids": []}]
    assert receipt["advice"]["refused"] is True
    (command,) = COMMAND.findall(line)
    long_ago(url)
    waited = follow(command, url)  # its worker is gone: the read-write open recovers it
    assert waited.returncode == EXIT_NEEDS_REVIEW, waited.stderr
    assert "ledger." not in waited.stdout
    assert COMMAND.findall(recovery(waited))[0] == f"stopline review show {run_id}/1:deploy"

    async def one_cancel() -> tuple[int, OpStatus]:
        async with stopline.open(url) as ledger:
            events = await ledger.backend.events(run_id)
            op = await ledger.backend.get_operation(f"{run_id}/1:deploy")
        return sum(e.kind == "cancel" for e in events), op.status

    assert anyio.run(one_cancel) == (1, OpStatus.NEEDS_REVIEW)  # the same one cancel (R7)


def test_a_refused_resume_while_settling_names_the_wait_command(tmp_path: Path) -> None:
    """``stopline resume`` of a run still settling answered "wait until it settles
    (ledger.wait_settled; ...), then ledger.resume and re-enter it"."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    run_id = anyio.run(left_settling, url)
    assert refused_resume(url, run_id) == [
        f"stopline cancel {run_id} --wait",
        f"stopline resume {run_id}",
    ]


def test_a_run_id_a_shell_would_split_or_read_as_an_option_is_quoted(tmp_path: Path) -> None:
    """An id with a space, or starting with ``-``, printed bare, was two arguments or an
    unknown option: it is quoted, behind ``--``."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"

    async def cancelled() -> None:
        async with stopline.open(url) as ledger:
            async with ledger.run("job", owner="user:1", run_id="-odd run") as run:
                await ledger.cancel(run.id, by="user:1")
            await ledger.wait_settled("-odd run", timeout=30)

    anyio.run(cancelled)
    line = recovery(stopline_cli("show", "--", "-odd run", ledger=url))
    (command,) = COMMAND.findall(line)
    assert command == "stopline resume -- '-odd run'"
    resumed = follow(command, url)
    assert resumed.returncode == EXIT_OK, resumed.stderr
    assert "Resumed run -odd run" in resumed.stdout
