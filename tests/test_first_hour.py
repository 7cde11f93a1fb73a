"""docs/first-hour.md, run as written, in one directory and in the order shown.

How the page is read:

- a ```python block whose first line is ``# file: NAME`` is saved as NAME;
- in a ```console block each ``$ `` line is a command. ``# terminal 1`` after
  it starts it in the background (the reader's first terminal); ``# exits N``
  is its exit code (0 otherwise). The lines under a command are output it
  must print (``...`` stands for lines not shown). ``pip install`` lines are
  the packaging test's job (tests/packaging) and are not run here;
- a ```text block is what the program in terminal 1 prints before it ends.

``stopline console`` gets ``--port 0`` (a free port: other servers run
here); the test then opens the cancelled run's page as the reader would.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "first-hour.md"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def steps(text: str) -> list[tuple[str, str]]:
    """(kind, body) for each fenced block, in order."""
    return [(m[1], m[2]) for m in re.finditer(r"^```(\w+)\n(.*?)^```$", text, re.M | re.S)]


class Reader:
    """Does what the page says, in ``where``."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.env = {k: v for k, v in os.environ.items() if k != "STOPLINE_LEDGER"}
        self.env["COLUMNS"] = "200"
        self.terminal1: subprocess.Popen[str] | None = None
        self.console_address = ""

    def argv(self, words: list[str]) -> list[str]:
        if words[0] == "stopline":
            return [sys.executable, "-m", "stopline.cli", *words[1:]]
        if words[0] == "python":
            return [sys.executable, *words[1:]]
        raise AssertionError(f"the page runs {words[0]!r}, which this test does not know")

    def run(self, command: str, shown: list[str]) -> None:
        line, _, comment = command.partition("  # ")
        words = shlex.split(line)
        if words[:2] == ["pip", "install"]:
            return
        if words[0] == "export":
            key, _, value = words[1].partition("=")
            self.env[key] = value
            return
        if words[0] == "touch":
            (self.where / words[1]).touch()
            return
        if "terminal 1" in comment:
            self.start(words, shown)
            return
        code = int(m[1]) if (m := re.search(r"exits (\d)", comment)) else 0
        done = subprocess.run(
            self.argv(words),
            cwd=self.where,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == code, (command, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr
        printed = [out.strip() for out in done.stdout.splitlines()]
        for expected in shown:
            assert expected.strip() in printed, (command, expected, done.stdout)

    def start(self, words: list[str], shown: list[str]) -> None:
        self.finish()
        console = words[:2] == ["stopline", "console"]
        argv = self.argv(words) + (["--port", "0"] if console else [])
        self.terminal1 = subprocess.Popen(
            argv,
            cwd=self.where,
            env={**self.env, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if console:
            assert self.terminal1.stderr is not None
            for _ in range(2):
                said = self.terminal1.stderr.readline()
            assert said.startswith("open http://127.0.0.1:"), said
            self.console_address = said.removeprefix("open ").strip()
            return
        assert self.terminal1.stdout is not None
        first = self.terminal1.stdout.readline().strip()
        assert shown and first == shown[0].strip()

    def finish(self, expected: list[str] | None = None) -> None:
        """Terminal 1's program ends (by itself, or Ctrl-C for the console)."""
        proc, self.terminal1 = self.terminal1, None
        if proc is None:
            return
        if self.console_address:
            proc.send_signal(2)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        for line in expected or ():
            assert line.strip() in [o.strip() for o in out.splitlines()], (line, out)


def test_the_first_hour_works_as_written(tmp_path: Path) -> None:
    reader = Reader(tmp_path)
    for kind, body in steps(PAGE.read_text()):
        if kind == "python":
            first, _, code = body.partition("\n")
            assert first.startswith("# file: ")
            (tmp_path / first.removeprefix("# file: ")).write_text(code)
        elif kind == "console":
            commands: list[tuple[str, list[str]]] = []
            for line in body.splitlines():
                if line.startswith("$ "):
                    commands.append((line[2:], []))
                elif line.strip() and line.strip() != "...":
                    commands[-1][1].append(line)
            for command, shown in commands:
                reader.run(command, shown)
        elif kind == "text":
            reader.finish(body.splitlines())
    assert not (tmp_path / "outbox.txt").exists()  # the newsletter never left
    # the reader opens the cancelled run in the console
    assert reader.console_address
    page = httpx.get(
        reader.console_address.replace("/?token=", "/runs/run_newsletter?token="),
        follow_redirects=True,
        timeout=30,
    )
    assert page.status_code == 200
    assert "Canceled before external action." in page.text
    assert 'data-mark="cancel"' in page.text and "newsletter" in page.text
    reader.finish()
