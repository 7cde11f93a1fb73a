"""`pip install stopline` with no extras, as a newcomer does it.

The sdist and the wheel are built from this checkout (the wheel from the
sdist, so a file missing from the sdist fails the build), the wheel is
installed into a fresh virtual environment without extras and without this
environment's site-packages, and the installed commands run. pip uses the
machine's own configuration, as the Makefile's pip does.
"""

from __future__ import annotations

import tarfile
import zipfile
from pathlib import Path

import pytest

import stopline
from stopline.demo import SEED_HEADLINES
from tests.packaging.conftest import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_sdist_holds_the_sources_tests_and_docs_and_nothing_else(dist: Path) -> None:
    (sdist,) = dist.glob("stopline-*.tar.gz")
    assert sdist.name == f"stopline-{stopline.__version__}.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for needed in (
        "pyproject.toml",
        "README.md",
        "CHANGELOG.md",
        "Makefile",
        "src/stopline/__init__.py",
        "src/stopline/py.typed",
        "src/stopline/console/templates/base.html",
        "docs/cli.md",
        "docs/first-hour.md",
        "tests/packaging/test_install.py",
    ):
        assert needed in names, needed
    stray = [n for n in names if n.startswith((".venv", ".git/", "dist/")) or n.endswith(".db")]
    assert stray == []


def test_the_wheel_ships_types_templates_and_the_command(dist: Path) -> None:
    (wheel,) = dist.glob("stopline-*.whl")
    assert wheel.name.startswith(f"stopline-{stopline.__version__}-")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = f"stopline-{stopline.__version__}.dist-info"
        scripts = whl.read(f"{info}/entry_points.txt").decode()
        metadata = whl.read(f"{info}/METADATA").decode()
    assert {"stopline/py.typed", "stopline/console/templates/run.html"} <= names
    assert not any(name.startswith("tests/") for name in names)
    assert "stopline = stopline.cli:main" in scripts
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    core = [line for line in requires if "extra ==" not in line]
    assert any("click" in line for line in core)
    assert any(line.startswith("Requires-Dist: mcp") for line in core)


def test_help_demo_and_runs_work_from_a_plain_install(venv: Path, tmp_path: Path) -> None:
    stopline_bin = venv / "bin" / "stopline"
    helped = run(stopline_bin, "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "demo" in helped.stdout and "runs" in helped.stdout

    url = f"sqlite:///{tmp_path / 'demo.db'}"
    demo = run(stopline_bin, "--ledger", url, "demo", cwd=tmp_path)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    for headline in SEED_HEADLINES:
        assert headline in demo.stdout

    runs = run(stopline_bin, "--ledger", url, "runs", cwd=tmp_path)
    assert runs.returncode == 0, runs.stderr
    assert "report-upload-notify" in runs.stdout and "needs_review" in runs.stdout
    assert "Traceback" not in demo.stderr + runs.stderr


def test_a_command_whose_extra_is_missing_names_the_extra(venv: Path, tmp_path: Path) -> None:
    python = venv / "bin" / "python"
    assert run(python, "-c", "import jinja2", cwd=tmp_path).returncode != 0  # no extras
    (tmp_path / "stopline.db").write_bytes(b"")
    console = run(venv / "bin" / "stopline", "console", cwd=tmp_path)
    assert console.returncode == 2
    assert "pip install 'stopline[console]'" in console.stderr
    assert "Traceback" not in console.stderr
    postgres = run(
        venv / "bin" / "stopline", "--ledger", "postgresql://127.0.0.1/x", "runs", cwd=tmp_path
    )
    assert postgres.returncode == 2
    assert "pip install 'stopline[postgres]'" in postgres.stderr
