"""Docs that run: every ```python block in README.md and docs/ is executed.

A ```text block right after a python block is the output it must print
(trailing spaces ignored). Each block runs in a fresh interpreter, in a
fresh directory, so examples cannot lean on one another. A block that starts
``# file: NAME`` is a file of a tutorial, run by that tutorial's own test
(docs/first-hour.md: tests/test_first_hour.py), not here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")


def blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, python code, expected output or None) for each python block."""
    lines = path.read_text().splitlines()
    found: list[tuple[str, int, str, int]] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match and match.group(1):
            start = i
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            found.append((match.group(1), start + 1, "\n".join(lines[i + 1 : j]), j + 1))
            i = j + 1
        else:
            i += 1
    out = []
    for n, (lang, line, body, end) in enumerate(found):
        if lang != "python" or body.startswith("# file: "):
            continue
        expected = None
        # its output: a ```text block starting right after it (prose may not intervene)
        if n + 1 < len(found) and found[n + 1][0] == "text" and found[n + 1][1] - end <= 2:
            expected = found[n + 1][2]
        out.append((line, body, expected))
    return out


CASES = [
    pytest.param(code, expected, id=f"{path.relative_to(ROOT)}:{line}")
    for path in DOCS
    for line, code, expected in blocks(path)
]


def test_docs_have_examples() -> None:
    assert len(CASES) >= 8


@pytest.mark.parametrize(("code", "expected"), CASES)
def test_doc_example_runs(code: str, expected: str | None, tmp_path: Path) -> None:
    env = {**os.environ, "STOPLINE_LEDGER": f"sqlite:///{tmp_path / 'stopline.db'}"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    if expected is not None:
        got = [line.rstrip() for line in done.stdout.strip().splitlines()]
        assert got == [line.rstrip() for line in expected.strip().splitlines()]


def test_semantics_diagram_is_the_transition_table() -> None:
    from stopline.domain.transitions import OPERATION_TABLE, RUN_TABLE, diagram

    text = (ROOT / "docs" / "semantics.md").read_text()
    assert diagram(OPERATION_TABLE) in text
    assert diagram(RUN_TABLE) in text


def test_the_pytest_example_passes_under_pytest_as_written(tmp_path: Path) -> None:
    """docs/testing.md's pytest file, run by pytest in a directory of its own."""
    text = (ROOT / "docs" / "testing.md").read_text()
    (example,) = [code for _, code, _ in blocks(ROOT / "docs" / "testing.md") if "# test_" in code]
    name = example.splitlines()[0].removeprefix("# ").strip()
    assert name in text
    (tmp_path / name).write_text(example)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert " passed" in done.stdout and "failed" not in done.stdout
