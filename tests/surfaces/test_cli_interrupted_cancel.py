"""``stopline cancel`` interrupted before the ledger answered says what it knows (R3).

The cancel's statement was on its way (here: waiting for a run's row another
session holds) when the operator pressed Ctrl-C twice. The command said
"interrupted before the cancel was recorded", which it cannot know: a commit
sent may land with no answer back (an outside probe saw the fence committed).
It says now that the cancel may be recorded or not, and how to find out; and
the interrupt prints no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import anyio
import psycopg
import pytest

import stopline
from stopline.cli import EXIT_PENDING
from stopline.ledger.backend import RunSpec
from tests.postgres.server import server_url

pytestmark = pytest.mark.timeout(90)


async def _running(url: str) -> None:
    async with stopline.open(url) as ledger:
        await ledger.backend.create_run(
            RunSpec(id="run_live", name="deploy", owner="user:cyd", tenant="default")
        )


def _waits_for(holder: int) -> bool:
    """Whether a session waits for a lock the session ``holder`` holds (this test's
    own: another test's waits, in parallel, are not this cancel's)."""
    with psycopg.connect(server_url(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
            (holder,),
        ).fetchone()
    return bool(row and row[0])


def test_a_cancel_interrupted_before_the_answer_may_be_recorded(pg_url: str) -> None:
    # here: test_cli_probe imports this module's helpers
    from tests.surfaces.test_cli_probe import _ctrl_c_until_it_ends

    anyio.run(_running, pg_url)
    schema = pg_url.split("schema=")[1].split("&")[0]
    with psycopg.connect(server_url(), autocommit=True) as other:
        other.execute(f'SET search_path = "{schema}"')
        other.execute("BEGIN")
        other.execute("SELECT id FROM runs WHERE id = 'run_live' FOR UPDATE")
        env = {**os.environ, "STOPLINE_LEDGER": pg_url + "&retry_for=120"}
        with subprocess.Popen(
            [sys.executable, "-m", "stopline.cli", "cancel", "run_live", "--by", "ops:kim"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        ) as proc:
            deadline = time.monotonic() + 60  # a guard, not a timing
            while not _waits_for(other.info.backend_pid):  # the cancel's statement is on the server
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
            # Ctrl-C: the first waits for the write on its way, the second ends it (ADR 0109)
            _, err = _ctrl_c_until_it_ends(proc)
        other.execute("ROLLBACK")
    assert proc.returncode == EXIT_PENDING, err
    assert "the cancel may be recorded or not" in err
    assert "stopline show run_live" in err
    assert "before the cancel was recorded" not in err
    assert "Traceback" not in err
