"""S17 for real: a worker process killed with SIGKILL at seeded points, many times.

Each cycle starts one worker process (forked from a preloaded fork server, so
a cycle costs milliseconds, not an interpreter start). The worker recovers,
reconciles, reports ``R`` and waits; the parent checks the ledger and the
provider's own record, then lets it run the keyed workflow and kills it at a
seeded point: paused exactly at a marker (before the gate, accepted, committed
at the provider, recorded) or asynchronously, a seeded number of markers in,
wherever it then is (inside a ledger transaction, between two). The next
worker resumes the same workflow under the same keys. After every restart and
reconciliation: every effect the provider recorded is committed in the
ledger, every operation is resolved or in review, no effect happened twice.
"""

from __future__ import annotations

import multiprocessing
import random
import sqlite3
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from tests.truth import s17_worker as worker

KILLS = 220
SEED = 17
_RESOLVED_OR_REVIEW = {"committed", "not_committed", "prevented", "compensated", "needs_review"}


def check(ledger: Path, provider: Path) -> tuple[int, int]:
    """The S17 invariants; returns (operations, effects)."""
    effects = worker.provider_effects(str(provider)) if provider.exists() else []
    twice = [key for key, n in Counter(effects).items() if n > 1]
    assert not twice, f"effects that happened twice: {twice}"
    with sqlite3.connect(ledger) as conn:
        ops = dict(conn.execute("SELECT id, status FROM operations").fetchall())
    left = {op: status for op, status in ops.items() if status not in _RESOLVED_OR_REVIEW}
    assert not left, f"operations neither resolved nor in review: {left}"
    in_review = [op for op, status in ops.items() if status == "needs_review"]
    assert not in_review, f"a verifiable provider should leave nothing to review: {in_review}"
    missing = [key for key in effects if ops.get(key) != "committed"]
    assert not missing, f"effects the ledger does not show committed: {missing}"
    phantom = [op for op, status in ops.items() if status == "committed" and op not in effects]
    assert not phantom, f"committed in the ledger with no effect at the provider: {phantom}"
    return len(ops), len(effects)


def _recv(conn: Connection, proc: multiprocessing.process.BaseProcess) -> bytes:
    if not conn.poll(30):
        raise AssertionError(f"worker {proc.pid} went silent")
    try:
        return conn.recv_bytes()
    except EOFError:
        proc.join(5)
        raise AssertionError(f"worker {proc.pid} exited with {proc.exitcode}") from None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_s17_worker_killed_mid_operation(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["stopline", "anyio", "tests.truth.s17_worker"])
    rng = random.Random(SEED)
    ledger_path, provider_path = tmp_path / "ledger.db", tmp_path / "provider.db"
    ledger_url = f"sqlite:///{ledger_path}?synchronous=NORMAL"  # WAL: survives a process kill
    kills = checks = runs = cycle = 0
    run_id, ops = "run_s17_0", rng.randint(3, 12)
    while kills < KILLS:
        cycle += 1
        before_ready = rng.random() < 0.1  # killed during its own recovery
        pause_at = None
        if rng.random() < 0.5:
            pause_at = f"{rng.randrange(ops)}:{rng.choice('gacd')}"
        kill_after = None if pause_at else rng.randint(1, 4 * ops)
        plan = worker.Plan(
            ledger_url, str(provider_path), run_id, ops, rng.randrange(1 << 30), pause_at
        )
        out_r, out_w = ctx.Pipe(duplex=False)
        go_r, go_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=worker.main, args=(plan, out_w, go_r), daemon=True)
        proc.start()
        out_w.close()
        go_r.close()
        killed = finished = False
        seen = 0
        try:
            while True:
                marker = _recv(out_r, proc)
                if marker == b"S" and before_ready:
                    killed = True
                    break
                if marker == b"R":
                    check(ledger_path, provider_path)
                    checks += 1
                    go_w.send_bytes(b"go")
                    continue
                if marker == b"F":
                    finished = True
                    break
                seen += 1
                if marker == b"!" or (kill_after is not None and seen >= kill_after):
                    killed = True
                    break
        finally:
            if killed:
                proc.kill()  # SIGKILL, wherever it is
            proc.join(30)
            out_r.close()
            go_w.close()
        assert killed or finished, f"cycle {cycle}: worker stopped without finishing"
        kills += killed
        if finished:
            runs += 1
            run_id, ops = f"run_s17_{runs}", rng.randint(3, 12)
    # a last worker recovers and reconciles after the last kill
    plan = worker.Plan(ledger_url, str(provider_path), run_id, ops, 0, None)
    out_r, out_w = ctx.Pipe(duplex=False)
    go_r, go_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=worker.main, args=(plan, out_w, go_r), daemon=True)
    proc.start()
    out_w.close()
    go_r.close()
    while _recv(out_r, proc) != b"R":
        pass
    n_ops, n_effects = check(ledger_path, provider_path)
    go_w.send_bytes(b"go")
    while _recv(out_r, proc) != b"F":
        pass
    proc.join(30)
    out_r.close()
    go_w.close()
    assert proc.exitcode == 0
    check(ledger_path, provider_path)
    assert kills >= 200 and checks >= 150
    assert n_ops > 200 and n_effects > 100  # the workload was real
