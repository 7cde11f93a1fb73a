"""The soak's crashes: workers killed at random (SIGKILL) and replaced, their runs judged
after.

A killed worker's in-process providers would die with it, and their truth with them, so
a crash soak's workers call ``SharedProvider``s: their ground truth is an SQLite file
every process shares. A request and its effect are one transaction there, so a worker
killed at any point left all of it or none. Once the faults are over, a judge process
opens the ledger with those tools (so it can read them back), which recovers what the
dead workers left in flight (their processes are gone: no lease to wait for), and judges
every run of every killed worker against the contract's rules: each operation that
passed the gate resolved, and the ledger agreeing with the provider's file.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from stopline.domain.vocab import Cancellable
from stopline.runtime.context import CallContext
from stopline.runtime.tool import ReadBack, Verdict
from stopline.testing import FakeProvider

__all__ = ["HORIZON", "SharedProvider", "crasher", "provider_path"]

# How long after its dispatch a request not in the provider's file never will be: the
# worker writes it within milliseconds of its gate, or was killed before (R13)
HORIZON = 5.0
_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (seq INTEGER PRIMARY KEY, key TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS effects (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def provider_path(workdir: Path) -> Path:
    return workdir / "provider.db"


class SharedProvider(FakeProvider):
    """A ``FakeProvider`` whose truth is an SQLite file: what it received, what it did.
    Idempotent by key; never cancellable; read back from the file. ``load()`` fills the
    in-memory truth the checks read (``requests``, ``committed``, ``effects``)."""

    def __init__(self, name: str, path: Path) -> None:
        super().__init__(name, cancellable=Cancellable.NEVER)
        self.tool.settles_within = HORIZON
        self._path = path
        with self._db() as db:
            db.executescript(_SCHEMA)

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self._path, timeout=60, isolation_level=None)
        try:
            yield db
        finally:
            db.close()

    async def _call(self, ctx: CallContext, payload: Any = None) -> dict[str, Any]:
        key, value = f"{self.name}:{ctx.key}", json.dumps(payload)
        with self._db() as db:  # blocking, and atomic: a kill leaves all of it or none
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO requests (key) VALUES (?)", (key,))
            found = db.execute("SELECT value FROM effects WHERE key = ?", (key,)).fetchone()
            if found is None:
                db.execute("INSERT INTO effects (key, value) VALUES (?, ?)", (key, value))
            db.execute("COMMIT")
        if found is not None:
            return {"id": ctx.key, "value": json.loads(found[0]), "replayed": True}
        return {"id": ctx.key, "value": payload}

    async def _verify(self, ctx: CallContext) -> ReadBack:
        key = f"{self.name}:{ctx.key}"
        with self._db() as db:
            found = db.execute("SELECT value FROM effects WHERE key = ?", (key,)).fetchone()
        if found is not None:
            result = {"id": ctx.key, "value": json.loads(found[0])}
            return ReadBack(Verdict.COMMITTED, key, "found by key", result)
        return ReadBack(Verdict.NOT_COMMITTED, ref=key, detail="no such key")

    def load(self) -> None:
        prefix = f"{self.name}:"
        with self._db() as db:
            requests = db.execute("SELECT key FROM requests ORDER BY seq").fetchall()
            effects = db.execute("SELECT key, value FROM effects ORDER BY rowid").fetchall()
        self.requests = [k[len(prefix) :] for (k,) in requests if k.startswith(prefix)]
        self.committed = {
            k[len(prefix) :]: json.loads(v) for k, v in effects if k.startswith(prefix)
        }
        self.effects = list(self.committed)


def crasher(
    procs: list[Any],
    replace: Callable[[], Any],
    killed: list[int],
    until: float,
) -> threading.Thread:
    """A thread that kills a random worker every 2-6 s until ``until`` and starts its
    replacement (``replace()``, a new seed); ``killed``: the seeds of the workers killed.
    ``procs``: (seed, process) of the live workers, changed in place."""

    def run() -> None:
        rng = random.Random()
        while time.time() < until:
            time.sleep(rng.uniform(2.0, 6.0))
            if time.time() >= until or not procs:
                return
            seed, proc = procs.pop(rng.randrange(len(procs)))
            proc.send_signal(signal.SIGKILL)
            proc.communicate()  # reaped, its pipe read and closed
            killed.append(seed)
            procs.append(replace())

    thread = threading.Thread(target=run, name="soak-crasher", daemon=True)
    thread.start()
    return thread
