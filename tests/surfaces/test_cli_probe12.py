"""Probe 12: Ctrl-C on the ``stopline`` command, from its start to a lock wait (ADR 0115).

- A Ctrl-C while the command's modules were importing, before its event loop took
  SIGINT, ended it with a ``KeyboardInterrupt`` traceback and status -2 (killed by the
  signal), or was lost. The command's entry (``stopline.cli.main``, behind both the
  ``stopline`` script and ``python -m stopline.cli``) now takes SIGINT before it
  imports them: the command ends before it starts, nothing done, with one line and
  its Ctrl-C exit code.
- After a first Ctrl-C on a statement waiting for another process's lock, nothing was
  printed until the second press: the operator could not tell whether the first had
  been taken. It says at once what it did and what a second does.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from stopline.cli import EXIT_PENDING
from tests.surfaces.test_cli_interrupted_cancel import _running
from tests.surfaces.test_cli_probe import (
    GUARD,
    SECOND_ENDS_IT,
    _ctrl_c_twice,
    _until_it_waits_for_sqlite,
)

pytestmark = pytest.mark.timeout(120)

STARTED = "interrupted before the command started; nothing was done"

# Loaded by the interpreter's start-up (``site``): when the command first imports typer
# (its own imports; ``import stopline`` does not) it says so on stderr and waits for a
# line on stdin, sent once the test has pressed Ctrl-C. The press lands in the import.
_BARRIER = textwrap.dedent(
    """
    import importlib.abc, sys

    class _Barrier(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "typer":
                sys.meta_path.remove(self)
                sys.stderr.write("barrier: importing typer\\n")
                sys.stderr.flush()
                sys.stdin.readline()
            return None

    sys.meta_path.insert(0, _Barrier())
    """
)

# A workflow module for ``map``: importing it leaves a file behind.
_WORKFLOW = "from pathlib import Path\nPath(__file__).with_suffix('.imported').touch()\n"


def _entry(how: str) -> list[str]:
    if how == "script":  # the console script pip installed beside this interpreter
        return [str(Path(sys.executable).with_name("stopline"))]
    return [sys.executable, "-m", "stopline.cli"]


def _files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


@pytest.mark.parametrize("how", ["module", "script"])
@pytest.mark.parametrize(
    ("args", "code"),
    [(("pause", "run_live", "--by", "ops:kim"), EXIT_PENDING), (("map", "workflow.py"), 130)],
)
def test_a_ctrl_c_while_the_command_imports_ends_it_before_it_starts(
    tmp_path: Path, how: str, args: tuple[str, ...], code: int
) -> None:
    """Ctrl-C during the imports: one line, the command's Ctrl-C exit code (3 for a
    command on the ledger, 130 for ``map``), no traceback, nothing written to the ledger
    and no workflow imported. It was a traceback and status -2."""
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    url = f"sqlite:///{ledger / 'ledger.db'}"
    anyio.run(_running, url)
    before = _files(ledger)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_BARRIER)
    (tmp_path / "workflow.py").write_text(_WORKFLOW)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "STOPLINE_LEDGER": url}
    with subprocess.Popen(
        [*_entry(how), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    ) as proc:
        assert proc.stdin is not None and proc.stderr is not None
        try:
            assert proc.stderr.readline() == "barrier: importing typer\n"
            proc.send_signal(signal.SIGINT)  # the press, while the import waits
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=GUARD)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == code, err
    assert err == f"stopline: {STARTED}\n"
    assert out == ""
    assert _files(ledger) == before  # not opened: nothing written, not even a journal
    assert not (tmp_path / "workflow.imported").exists()


def test_the_first_ctrl_c_on_a_lock_wait_says_at_once_what_it_did(tmp_path: Path) -> None:
    """A first Ctrl-C on ``pause`` waiting for another process's write lock says at once
    that the command stops once the ledger has answered, and that a second press ends
    it now; the second does. It said nothing until the second press."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    anyio.run(_running, url)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process's write lock, held throughout
    try:
        with subprocess.Popen(
            [sys.executable, "-m", "stopline.cli", "pause", "run_live", "--by", "ops:kim"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "STOPLINE_LEDGER": url + "?busy_timeout=120"},
        ) as proc:
            try:
                _until_it_waits_for_sqlite(proc)  # a statement on its way, waiting
                pressed = _ctrl_c_twice(proc)
            finally:
                if proc.poll() is None:
                    proc.kill()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    first, rest = pressed.err.split("\n", 1)
    assert first.startswith("stopline: stopping: the command ends once the ledger has answered")
    assert SECOND_ENDS_IT in first
    assert pressed.pressed_twice  # the lock is held: the first press did not end it
    assert proc.returncode == EXIT_PENDING, pressed.err
    assert "the pause may be recorded or not. See with: stopline show run_live" in rest
    assert "Traceback" not in rest


@pytest.fixture
def _sigint_kept() -> Iterator[None]:
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.usefixtures("_sigint_kept")
def test_a_press_while_starting_is_counted_and_the_command_ends() -> None:
    """In-process: presses while the modules import are counted, never raised, and
    SIGINT is ignored after them (the command ends); without one it is Python's again."""
    from stopline.cli._loop import Starting, starting  # here: the old code had neither

    with starting() as start:
        assert isinstance(signal.getsignal(signal.SIGINT), Starting)
    assert start.presses == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with starting() as start:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
    assert start.presses == 2
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


@pytest.mark.usefixtures("_sigint_kept")
def test_a_start_with_sigint_ignored_keeps_ignoring_it() -> None:
    """Guards what held: a command a shell started in the background ignores SIGINT."""
    from stopline.cli._loop import starting

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with starting():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--ledger", "map", "runs"], EXIT_PENDING),  # "map" is the ledger's URL here
        (["--ledger=x", "check-mcp", "URL"], 130),
        (["demo"], 130),
        (["--version"], EXIT_PENDING),
        (["review", "list"], EXIT_PENDING),
    ],
)
def test_the_exit_code_of_a_command_interrupted_at_its_start(
    argv: list[str], code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    from stopline.cli._app import interrupted_at_start

    assert interrupted_at_start(argv) == code
    assert STARTED in capsys.readouterr().err
