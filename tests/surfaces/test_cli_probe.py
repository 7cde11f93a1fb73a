"""What a new user met following README.md, docs/first-hour.md and docs/cli.md (CLI probe).

- Tables folded values mid-word (``needs_rev``/``iew``) in a pipe, so ``grep`` missed
  them; on a 20-column terminal they cut run ids (``run_1ae2…``) and left out every
  column but the first.
- Ctrl-C twice ended ``pause`` (and every command but ``cancel`` and ``reconcile``)
  with exit 130 and not a word; on a SQLite ledger locked by another process the
  command hung at exit for ever, until a third Ctrl-C printed a traceback.
- On an ASCII stdout (``LANG=C`` without UTF-8) a run named ``café`` ended ``runs``
  with a ``UnicodeEncodeError`` traceback.
- A receipt in review ended ``needs_review, settled``, though a reviewer's decision
  changes it (exit 4, not 0).
- A directory given as the ledger was "no ledger file there".
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import signal
import sqlite3
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import IO

import anyio
import psycopg
import pytest

import stopline
from stopline.cli import EXIT_ERROR, EXIT_OK, EXIT_PENDING
from stopline.cli.views import fmt_time
from tests.postgres.server import server_url
from tests.surfaces.seed import Seeded, seed
from tests.surfaces.test_cli import stopline_cli
from tests.surfaces.test_cli_interrupted_cancel import _running, _waits_for

pytestmark = pytest.mark.timeout(120)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Seeded]:
    url = f"sqlite:///{tmp_path_factory.mktemp('probe') / 'ledger.db'}"
    return url, anyio.run(seed, url)


def on_terminal(url: str, columns: int, *args: str) -> tuple[int, str]:
    """The command with its stdout on a real terminal (a pty) ``columns`` wide."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env |= {"TERM": "xterm", "STOPLINE_LEDGER": url}
    with subprocess.Popen(
        [sys.executable, "-m", "stopline.cli", *args],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=subprocess.DEVNULL,
        env=env,
    ) as proc:
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the command closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=60)
    os.close(master)
    return code, _ANSI.sub("", b"".join(chunks).decode()).replace("\r\n", "\n")


def _runs(url: str) -> list[dict[str, str]]:
    listed: list[dict[str, str]] = json.loads(stopline_cli("runs", "--json", ledger=url).stdout)
    return listed


def test_a_piped_table_keeps_each_row_on_one_line(seeded: tuple[str, Seeded]) -> None:
    """`stopline runs | grep needs_review` finds the run in review, whatever COLUMNS."""
    url, ids = seeded
    done = stopline_cli("runs", ledger=url, env={"COLUMNS": "40"})
    assert done.returncode == EXIT_OK, done.stderr
    for run in _runs(url):
        line = next(line for line in done.stdout.splitlines() if run["id"] in line.split())
        words = line.split()
        assert words[1:4] == [run["name"], run["owner"], run["state"]]
        assert words[-1] == run["headline"]
    review = [line.split()[0] for line in done.stdout.splitlines() if "needs_review" in line]
    assert review == [ids.review]


@pytest.mark.parametrize("columns", [20, 60])
def test_a_narrow_terminal_shows_every_value_whole(
    seeded: tuple[str, Seeded], columns: int
) -> None:
    url, _ = seeded
    code, text = on_terminal(url, columns, "runs")
    assert code == EXIT_OK, text
    blocks: dict[str, dict[str, str]] = {}  # too narrow for a table: a block per run
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith(" "):
            blocks[line] = fields = {}
        elif line.strip():
            key, _, value = line.strip().partition(": ")
            fields[key] = value
    for run in _runs(url):  # each run id whole, to be copied into the next command
        assert blocks[run["id"]]["STATE"] == run["state"]
        assert blocks[run["id"]]["HEADLINE"] == run["headline"]
        assert blocks[run["id"]]["NAME"] == run["name"]
        assert blocks[run["id"]].get("PHASE") == run["phase"]
    assert "…" not in text


@pytest.mark.parametrize("columns", [20, 100])
def test_a_timeline_on_a_terminal_breaks_no_word(seeded: tuple[str, Seeded], columns: int) -> None:
    """Every word of the timeline as printed is a word the ledger's values hold: a value
    wraps at its spaces, never inside a word."""
    url, ids = seeded
    shown = json.loads(stopline_cli("show", ids.review, "--json", ledger=url).stdout)
    allowed = {"TIME", "WHAT", "EVENT", "STATUS", "DETAIL", "/", "EVIDENCE"}
    allowed |= {"WHAT:", "EVENT:", "STATUS:", "EVIDENCE:"}
    for e in shown["timeline"]:
        refs = ", ".join(f"{ev['kind']}:{ev['ref']}" for ev in e["evidence"])
        detail = "; ".join(part for part in (e["detail"], refs) if part)
        cells = (fmt_time(e["at"], clock=True), e["subject"], e["words"], e["transition"], detail)
        allowed |= {word for cell in cells for word in cell.split()}
    code, text = on_terminal(url, columns, "show", ids.review)
    assert code == EXIT_OK, text
    timeline = text.split("timeline\n", 1)[1].split("\n\nreceipt", 1)[0]
    printed = set(timeline.split())
    assert printed <= allowed, printed - allowed
    for e in shown["timeline"]:  # and no column left out
        assert set(e["words"].split()) | set(e["subject"].split()) <= printed, e
    if timeline.split()[0] == "TIME":  # laid out as a table: it fits the terminal
        assert max(len(line) for line in timeline.splitlines()) <= columns


async def _named(url: str) -> None:
    async with stopline.open(url) as ledger, ledger.run("café ☕", owner="user:zoë"):
        pass


def test_an_ascii_stdout_prints_what_it_cannot_encode_escaped(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_named, url)
    ascii_only = {"LC_ALL": "C", "LANG": "C", "PYTHONIOENCODING": "ascii"}
    done = stopline_cli("runs", ledger=url, env=ascii_only)
    assert done.returncode == EXIT_OK, done.stderr
    assert "Traceback" not in done.stderr
    assert "caf\\xe9 \\u2615" in done.stdout and "user:zo\\xeb" in done.stdout


def test_a_receipt_in_review_is_not_called_settled(seeded: tuple[str, Seeded]) -> None:
    url, ids = seeded
    done = stopline_cli("show", ids.review, ledger=url)
    assert done.returncode == EXIT_OK, done.stderr
    assert f"run {ids.review}: needs_review, waiting for a reviewer" in done.stdout
    assert "needs_review, settled" not in done.stdout


def test_a_directory_is_not_a_ledger_file(tmp_path: Path) -> None:
    done = stopline_cli("runs", ledger=f"sqlite:///{tmp_path}")
    assert done.returncode == EXIT_ERROR
    assert "that is a directory: name the ledger file in it" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing created in it


def test_console_help_names_the_value_allow_host_takes() -> None:
    done = stopline_cli("console", "--help")
    assert "--allow-host HOST" in done.stdout
    assert "list[str]" not in done.stdout


# -- Ctrl-C -------------------------------------------------------------------------


# What the first Ctrl-C says at once, on stderr: a second one ends the command now.
SECOND_ENDS_IT = "Ctrl-C again ends it now"
GUARD = 60  # seconds: a hang guard, not a timing


@dataclasses.dataclass(frozen=True)
class Pressed:
    """A command Ctrl-C ended: what it printed, and whether it still ran once the first
    press had said what it did (a second was pressed then)."""

    out: str
    err: str
    pressed_twice: bool


def _ctrl_c_twice(proc: subprocess.Popen[str]) -> Pressed:
    """Ctrl-C, and once the command has said what that did (``SECOND_ENDS_IT``, at once
    on stderr) a second if it is still running: for a command the first cannot end (it
    waits for a lock held throughout). It pressed again only if the command had not
    ended within 10 s, since it said nothing until then; and not every 0.2 s, where one
    may be enough: one landing while the interpreter tears down after the report ends it
    by the signal (Python's own: status -2), not by its status."""
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []
    said = threading.Event()

    def read(stream: IO[str]) -> None:
        for line in stream:
            lines.append(line)
            if SECOND_ENDS_IT in line:
                said.set()
        said.set()  # the command ended: nothing more comes

    reader = threading.Thread(target=read, args=(proc.stderr,), name="stderr")
    reader.start()
    try:
        proc.send_signal(signal.SIGINT)
        assert said.wait(GUARD), "".join(lines)
        assert any(SECOND_ENDS_IT in line for line in lines), "".join(lines)
        twice = proc.poll() is None
        if twice:
            proc.send_signal(signal.SIGINT)
        proc.wait(GUARD)
    finally:
        if proc.poll() is None:  # a failed assertion: the command still waits
            proc.kill()
        reader.join()
    return Pressed(proc.stdout.read(), "".join(lines), twice)


def _ctrl_c_until_it_ends(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """``_ctrl_c_twice``: stdout and stderr."""
    pressed = _ctrl_c_twice(proc)
    return pressed.out, pressed.err


def _cli(url: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "stopline.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "STOPLINE_LEDGER": url},
    )


@pytest.mark.parametrize(
    ("args", "lock", "said"),
    [
        (
            ("pause", "run_live"),
            "SELECT id FROM runs WHERE id = 'run_live' FOR UPDATE",
            "the pause may be recorded or not. See with: stopline show run_live",
        ),
        (("runs",), "LOCK TABLE runs IN ACCESS EXCLUSIVE MODE", "nothing was changed (a read)"),
    ],
)
def test_ctrl_c_on_a_statement_waiting_for_postgres_says_what_is_known(
    pg_url: str, args: tuple[str, ...], lock: str, said: str
) -> None:
    anyio.run(_running, pg_url)
    schema = pg_url.split("schema=")[1].split("&")[0]
    with psycopg.connect(server_url(), autocommit=True) as other:
        other.execute(f'SET search_path = "{schema}"')
        other.execute("BEGIN")
        other.execute(lock)
        with _cli(pg_url + "&retry_for=120", *args) as proc:
            deadline = time.monotonic() + 60  # a guard, not a timing
            while not _waits_for(other.info.backend_pid):  # the statement is on the server
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
            _, err = _ctrl_c_until_it_ends(proc)
        other.execute("ROLLBACK")
    assert proc.returncode == EXIT_PENDING, err
    assert said in err
    assert "Traceback" not in err


def _sleeps_in_a_lock_wait(pid: int) -> bool:
    """Whether a thread of the process ``pid`` sleeps in SQLite's busy handler, between
    two tries at a lock another connection holds (Linux: the kernel's wait channel; no
    other thread of a command sleeps so, the loop waits in epoll and the others on
    futexes)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            if Path(f"/proc/{pid}/task/{task}/wchan").read_text() == "hrtimer_nanosleep":
                return True
    return False


def _until_it_waits_for_sqlite(proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + GUARD  # a guard, not a timing
    while not _sleeps_in_a_lock_wait(proc.pid):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)


def test_ctrl_c_twice_on_a_locked_sqlite_ledger_ends_the_command(tmp_path: Path) -> None:
    """The lock wait runs in a worker thread: the second Ctrl-C left the interpreter
    waiting for it at exit, for ever."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    anyio.run(_running, url)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process's write lock, held throughout
    try:
        with _cli(url + "?busy_timeout=120", "pause", "run_live") as proc:
            _until_it_waits_for_sqlite(proc)  # a statement on its way: Ctrl-C is the command's
            _, err = _ctrl_c_until_it_ends(proc)  # one cannot end a lock wait
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert proc.returncode == EXIT_PENDING, err
    assert "the pause may be recorded or not. See with: stopline show run_live" in err
    assert "Traceback" not in err
