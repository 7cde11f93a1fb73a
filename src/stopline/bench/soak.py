"""`stopline bench --soak`: worker processes, a canceller and random storage faults.

Four worker processes run workflows on one ledger while a canceller process
cancels some of their runs and this process injects real faults at random.
On SQLite: another process holding the write lock past the workers' busy
timeout, and (where this process may mount one, as root) the ledger's own
small tmpfs filled up and freed. The tmpfs is sized for the soak's length
(``disk_mib``): the ledger grew ~19 MiB a minute here, and a disk the
ledger itself had filled would stay full after the faults stopped. On
PostgreSQL (``--postgres``, a schema of its own): the workers' connections
terminated, one or all at once, and live runs locked by another session
(``_soak_postgres``). With ``crashes``, workers are also killed at random and
replaced, and their runs judged by another process once it recovered them
(``_soak_crash``). When the time is up the faults stop, every worker
waits for its runs to settle and checks each against the contract's rules
(``stopline.testing.checks``) and one more: no run was cancelled that the
canceller did not cancel. It prints

    operations, typed errors, faults, the ledger's size at the end (MiB, its
    log or its indexes included), workers still at their checks 15 minutes
    after the faults stopped (killed; must be 0), violations (must be 0) and
    process teardowns (must be 0: a worker that died)

and exits 1 if any of the last three is not 0. Not part of ``stopline
bench``'s default run.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

from stopline.bench import _soak_crash
from stopline.bench.options import check_minutes, check_server

__all__ = ["main", "soak"]

CANCELLER = "soak:canceller"
_WORKERS = 4
_BUSY_TIMEOUT = 0.1  # a worker's wait for the lock before its call gets LedgerLocked
_CHECKS_S = 900.0  # how long the children may take over their checks once the faults stop


def main(
    *,
    seconds: float,
    workers: int = _WORKERS,
    postgres: str | None = None,
    crashes: bool = False,
) -> int:
    """Run the soak, print its figures; 0 if nothing was violated and nothing torn down.
    ``postgres``: a server to soak on (a schema of its own) instead of a SQLite file.
    ``crashes``: workers are killed too (``_soak_crash``)."""
    check_minutes(seconds / 60)
    if postgres is not None:
        check_server(postgres)
    with tempfile.TemporaryDirectory(prefix="stopline-soak-") as tmp:
        figures = soak(
            Path(tmp), seconds=seconds, workers=workers, postgres=postgres, crashes=crashes
        )
    for name, value in figures.items():
        print(f"{name:<16} {value}")
    failed = figures["violations"] or figures["teardowns"] or figures["hung"]
    return 1 if failed else 0


def soak(
    workdir: Path,
    *,
    seconds: float,
    workers: int = _WORKERS,
    postgres: str | None = None,
    crashes: bool = False,
) -> dict[str, Any]:
    """The soak itself (blocking: it manages processes); its figures."""
    if postgres is not None:
        from stopline.bench import _soak_postgres as pg

        with pg.ledger(postgres) as (url, schema):
            faults, results = _roles(
                workdir,
                url,
                seconds,
                workers,
                lambda until: pg.inject(postgres, schema, until),
                crashes,
            )
            size = pg.size_mib(postgres, schema)
        return _figures(results, faults, size)
    with _disk(workdir, disk_mib(seconds)) as (directory, disk):
        path = directory / "ledger.db"
        url = f"sqlite:///{path}?busy_timeout={_BUSY_TIMEOUT}"
        faults, results = _roles(
            workdir, url, seconds, workers, lambda until: _inject(path, disk, until), crashes
        )
        size = sum(f.stat().st_size for f in directory.glob("ledger.db*")) / 2**20
    return _figures(results, faults, size)


def _roles(
    workdir: Path,
    url: str,
    seconds: float,
    workers: int,
    inject: Callable[[float], dict[str, int]],
    crashes: bool = False,
) -> tuple[dict[str, int], list[dict[str, Any] | None]]:
    """The workers and the canceller on ``url`` while ``inject`` makes faults: (the faults
    made, each child's figures or ``None`` for one that died). ``crashes``: workers are
    killed and replaced meanwhile, and a judge checks the killed workers' runs after."""
    # the ledger exists before anyone races to create it
    _child("create", url, "0", str(workdir / "unused"), "0")
    stop_file = workdir / "faults-over"
    deadline = str(time.time() + seconds)
    role = "crash-worker" if crashes else "worker"
    seeds = itertools.count()

    def worker() -> tuple[int, subprocess.Popen[str]]:
        seed = next(seeds)
        return seed, _spawn(role, url, deadline, str(stop_file), str(seed))

    live = [worker() for _ in range(workers)]
    canceller = _spawn("canceller", url, deadline, str(stop_file), "0")
    killed: list[int] = []
    crasher = _soak_crash.crasher(live, worker, killed, float(deadline)) if crashes else None
    faults = inject(float(deadline))
    if crasher is not None:
        crasher.join()
        faults["workers_killed"] = len(killed)
    stop_file.touch()
    checks_until = time.monotonic() + _CHECKS_S
    results = [_collect(p, checks_until) for p in [*(p for _, p in live), canceller]]
    if crashes:
        (workdir / "killed.json").write_text(json.dumps(killed))
        judge = _spawn("judge", url, deadline, str(stop_file), "0")
        results.append(_collect(judge, time.monotonic() + _CHECKS_S))
    return faults, results


def _figures(
    results: list[dict[str, Any] | None], faults: dict[str, int], size: float
) -> dict[str, Any]:
    totals: dict[str, Any] = {
        "operations": 0,
        "typed_errors": 0,
        "cancels": 0,
        "hung": 0,
        "judged": 0,
    }
    violations: list[str] = []
    teardowns = 0
    for result in results:
        if result is None:
            teardowns += 1
            continue
        for name in totals:
            totals[name] += result.get(name, 0)
        violations.extend(result.get("violations", []))
    return {
        **totals,
        "faults": faults,
        "ledger_mib": round(size, 1),
        "violations": len(violations),
        "teardowns": teardowns,
        "first_violations": violations[:5],
    }


# -- the faults (this process) -------------------------------------------------------
def disk_mib(seconds: float) -> int:
    """The ledger's tmpfs for a soak of ``seconds``: 64 MiB and 40 a minute (the ledger,
    its log included, grew to 149 MiB in an 8-minute soak; with a fixed 64 MiB it
    filled the disk itself after 2-3 minutes, and every write failed from then on)."""
    return 64 + math.ceil(40 * seconds / 60)


@contextlib.contextmanager
def _disk(workdir: Path, mib: int) -> Iterator[tuple[Path, Path | None]]:
    """A small tmpfs of ``mib`` for the ledger where this process may mount one, else a
    plain dir."""
    mount = workdir / "disk"
    mount.mkdir()
    mounted = os.geteuid() == 0 and (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(mount)],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    try:
        yield mount, (mount if mounted else None)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def _inject(path: Path, disk: Path | None, until: float) -> dict[str, int]:
    """Random faults until ``until``: each lasts 50-300 ms, with quiet stretches between."""
    rng = random.Random()
    counts = {"locked": 0, "disk_full": 0}
    while time.time() < until:
        time.sleep(rng.uniform(0.2, 1.0))
        length = rng.uniform(0.05, 0.3)
        if disk is not None and rng.random() < 0.5:
            counts["disk_full"] += 1
            filler = disk / "filler"
            _fill(filler)
            time.sleep(length)
            filler.unlink(missing_ok=True)
        else:
            counts["locked"] += 1
            with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
                try:
                    conn.execute("BEGIN IMMEDIATE")
                except sqlite3.OperationalError:
                    continue  # a worker holds it right now: try again later
                time.sleep(length)
                conn.execute("ROLLBACK")
    return counts


def _fill(filler: Path) -> None:
    chunk = b"\0" * 65536
    with filler.open("ab", buffering=0) as out, contextlib.suppress(OSError):
        while True:
            out.write(chunk)


# -- the child processes -----------------------------------------------------------------
def _spawn(role: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "stopline.bench.soak", role, *args],
        stdout=subprocess.PIPE,
        text=True,
    )


def _child(role: str, *args: str) -> None:
    command = [sys.executable, "-m", "stopline.bench.soak", role, *args]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def _collect(proc: subprocess.Popen[str], until: float) -> dict[str, Any] | None:
    """A child's figures; ``None`` if it died (a teardown). One still at its checks at
    ``until`` is killed and reported as hung (it would outlive the soak's ledger)."""
    try:
        out, _ = proc.communicate(timeout=max(until - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"hung": 1}
    if proc.returncode != 0:
        return None
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


if __name__ == "__main__":
    from stopline.bench import _soak_roles

    role, url, deadline, stop_file, seed = sys.argv[1:6]
    figures = anyio.run(_soak_roles.run, role, url, float(deadline), Path(stop_file), int(seed))
    print(json.dumps(figures))
