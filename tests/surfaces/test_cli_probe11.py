"""Probe 11: Ctrl-C on a command waiting on the ledger ends it once the work has unwound.

The first Ctrl-C cancels the command's coroutine and the main thread was to wait for
it to unwind, its ledger closed. It did not, on Python 3.11 and 3.12: the
``KeyboardInterrupt`` raised in ``Thread.join`` marks the thread as ended while it
still runs (CPython's fix of bpo-45274 releases the thread's lock when the wait is
interrupted), so the next ``join`` returned at once, and the command printed its report
and exited with its ledger still closing: the close's writes (the worker's retirement,
outcomes queued for the next group commit) were cut with the process. The command
now takes SIGINT with a handler of its own (``cli._loop``): the first press asks the
work to stop and returns, and the main thread goes on waiting for it.

A Ctrl-C landing just after the fence committed, before its answer was read, said
"the cancel may be recorded or not" although this process saw it commit (the test
of the wait, ``test_cli.py``, failed so 3 times in 600 loaded runs): the command
reads the receipt of a cancel it saw committed and says it is recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import typer

from stopline.cli import EXIT_PENDING
from stopline.cli import _common as c
from tests.surfaces.test_cli import _left_running, _until_cancelled

pytestmark = pytest.mark.timeout(60)

GUARD = 30  # seconds: a hang guard, not a timing


def test_ctrl_c_while_waiting_ends_once_the_ledger_is_closed(tmp_path: Path) -> None:
    """One Ctrl-C while ``cancel --wait`` waits: exit 3 with the receipt, and by then the
    command's ledger has closed (its worker retired: no lease of it left in the ledger).
    It exited with the close still under way, and the worker stayed "live" in the
    ledger until its lease ran out."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    run_id = anyio.run(_left_running, url, True)
    env = {**os.environ, "STOPLINE_LEDGER": url}
    with subprocess.Popen(
        [sys.executable, "-m", "stopline.cli", "cancel", run_id, "--wait", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        anyio.run(_until_cancelled, url, run_id)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == EXIT_PENDING, err
    assert "Traceback" not in err
    assert "the cancel is recorded in the ledger" in err
    assert json.loads(out)["run_state"] == "cancelling"
    with contextlib.closing(sqlite3.connect(path)) as db:
        held = "SELECT id FROM workers WHERE pid = ? AND lease_until > 0"
        assert db.execute(held, (proc.pid,)).fetchall() == []  # retired as its ledger closed


@pytest.fixture
def _sigint_kept() -> Iterator[None]:
    """This process's SIGINT handler as it was, after a command a Ctrl-C ended (which
    leaves SIGINT ignored: its process is ending)."""
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


@contextlib.contextmanager
def _ctrl_c_once(started: threading.Event) -> Iterator[None]:
    """One Ctrl-C to this process's main thread once ``started`` is set."""
    main = threading.main_thread().ident
    assert main is not None

    def press() -> None:
        if started.wait(GUARD):
            signal.pthread_kill(main, signal.SIGINT)

    presser = threading.Thread(target=press, name="ctrl-c")
    presser.start()
    try:
        yield
    finally:
        started.set()  # the presser ends whatever happened
        presser.join()


@pytest.mark.usefixtures("_sigint_kept")
def test_the_first_ctrl_c_waits_for_the_work_to_unwind() -> None:
    """In the command's own process (pytest's main thread takes the signal, as the CLI's
    does): the work's cleanup waits for a barrier that opens only once the cleanup has
    begun, so it is under way when the Ctrl-C has been taken. The report comes after it
    ended; it came while it still ran, the main thread no longer waiting."""
    started, cleaning, release, cleaned = (threading.Event() for _ in range(4))
    seen: list[bool] = []

    async def work() -> None:
        try:
            started.set()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                cleaning.set()
                await anyio.to_thread.run_sync(release.wait)
                cleaned.set()

    def releaser() -> None:
        if cleaning.wait(GUARD):
            release.set()

    def report() -> int:
        seen.append(cleaned.is_set())
        release.set()  # the work never waits on after the report
        return EXIT_PENDING

    opener = threading.Thread(target=releaser, name="release")
    opener.start()
    try:
        with _ctrl_c_once(started), pytest.raises(typer.Exit) as ended:
            c.run_sync(work, interrupted=report)
    finally:
        cleaning.set()
        opener.join()
    assert ended.value.exit_code == EXIT_PENDING
    assert seen == [True]
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the command is ending


def test_a_command_started_with_sigint_ignored_keeps_ignoring_it() -> None:
    """Guards what held: a command a shell started in the background (SIGINT ignored)
    does not take Ctrl-C while it runs, and SIGINT is as it was after."""
    seen: list[object] = []

    async def work() -> str:
        seen.append(signal.getsignal(signal.SIGINT))
        return "done"

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert c.run_sync(work, interrupted="interrupted") == "done"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [signal.SIG_IGN]


def test_sigint_is_given_back_after_a_command() -> None:
    """Guards what held: after a command, SIGINT is the handler it was before."""
    before = signal.getsignal(signal.SIGINT)

    async def work() -> int:
        return 1

    assert c.run_sync(work, interrupted="interrupted") == 1
    assert signal.getsignal(signal.SIGINT) is before
