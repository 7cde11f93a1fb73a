"""The wheel built from this checkout and a fresh virtual environment with it
installed (no extras, no site-packages of this environment), built once for the
package's modules: each of them read both (a second build and install cost ~30 s).
pip uses the machine's own configuration, as the Makefile's pip does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STOPLINE_LEDGER")}
    return subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )


@pytest.fixture(scope="package")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    built = run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT, cwd=out)
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def installed(where: Path, dist: Path, extras: str = "", *options: str) -> Path:
    """A fresh virtual environment at ``where`` with the wheel of ``dist`` (and
    ``extras``) installed by pip with ``options``."""
    made = run(sys.executable, "-m", "venv", where, cwd=where.parent)
    assert made.returncode == 0, made.stderr
    (wheel,) = dist.glob("stopline-*.whl")
    wanted = f"{wheel}[{extras}]" if extras else str(wheel)
    pip: list[str | Path] = [where / "bin" / "python", "-m", "pip", "install", "--quiet"]
    done = run(*pip, *options, wanted, cwd=dist)
    assert done.returncode == 0, done.stdout + done.stderr
    return where


@pytest.fixture(scope="package")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plain install the tests only read (none installs into it)."""
    return installed(tmp_path_factory.mktemp("venv") / "venv", dist)
