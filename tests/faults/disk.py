"""Storage faults on real files: a tiny tmpfs filled up, or a file size limit.

Where this process may mount (root with ``CAP_SYS_ADMIN``) the ledger lives
on its own small tmpfs and the fault is the real one, a full disk. Elsewhere
the same scenario runs in a child process under ``RLIMIT_FSIZE`` (with
``SIGXFSZ`` ignored, so a write past the limit fails instead of killing it):
either way the test runs, it never skips.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

__all__ = ["Disk", "integrity", "limit_file_size", "read_only", "tiny_disk"]


class Disk:
    """A directory on a small tmpfs that can be filled and freed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._filler = path / "filler"

    def fill(self) -> None:
        """Write until the disk is full (ENOSPC)."""
        chunk = b"\0" * 4096
        with self._filler.open("ab", buffering=0) as out:  # unbuffered: close flushes nothing
            try:
                while True:
                    out.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)


def _mount(path: Path, size_kb: int) -> bool:
    if os.geteuid() != 0:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


@contextlib.contextmanager
def tiny_disk(base: Path, size_kb: int = 2048) -> Iterator[Disk | None]:
    """A small tmpfs under ``base``; ``None`` where this process cannot mount one."""
    path = base / "disk"
    path.mkdir()
    if not _mount(path, size_kb):
        yield None
        return
    try:
        yield Disk(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def limit_file_size(limit: int | None) -> None:
    """In a child process: writes past ``limit`` bytes fail with EFBIG (``None`` lifts it)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if limit is None else limit, hard))


def integrity(path: Path) -> str:
    """``PRAGMA integrity_check`` of a ledger file (``ok`` when consistent)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` (a file or a directory) read-only: a read-only bind mount where this
    process may mount (root ignores file modes), file modes otherwise."""
    if os.geteuid() == 0:
        for args in (["--bind", str(path), str(path)], ["-o", "remount,ro,bind", str(path)]):
            done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"root without mount permission: {done.stderr.strip()}")
        try:
            yield
        finally:
            subprocess.run(["umount", str(path)], capture_output=True, check=False)
        return
    mode = path.stat().st_mode
    path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        yield
    finally:
        path.chmod(mode)
