"""The ``stopline`` command used from outside, on ledgers a worker wrote (CLI probe 3).

- ``stopline reconcile`` after a worker died with calls in flight that nobody can
  read back: opening the ledger recovered them and sent them to review (R2, R5), and
  the pass that followed found nothing left, so the command printed "reconciled 0
  operation(s): nothing to do" and exited 0, where the operator's ledger now held
  those operations waiting for a reviewer (documented: exit 4 when some went to
  review).
- Ctrl-C on ``reconcile`` said "`stopline reconcile` goes on from there", which then
  says "nothing to do" of the calls the interrupted one's open sent to review.
- ``--since ''`` (an unset shell variable) listed every run, where ``--since 3x``
  is a usage error, as an empty ``--owner`` is.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import psycopg
import pytest

import stopline
from stopline.cli import EXIT_NEEDS_REVIEW, EXIT_PENDING, EXIT_USAGE
from tests.postgres.server import server_url
from tests.surfaces.test_cli import as_json, stopline_cli
from tests.surfaces.test_cli_interrupted_cancel import _running, _waits_for
from tests.surfaces.test_cli_probe import _cli, _ctrl_c_until_it_ends

pytestmark = pytest.mark.timeout(120)

# A worker that dies (os._exit: no close, no lease retired) while its call is in
# flight: the call's intent is durable, its tool declares no verifier.
_DYING_WORKER = textwrap.dedent(
    """
    import os, sys, anyio, stopline
    from stopline import PhaseKind

    async def send(payload: str) -> str:
        print("in flight", flush=True)
        sys.stdin.readline()  # the test has seen the line: die now
        os._exit(0)

    async def main() -> None:
        async with stopline.open(sys.argv[1]) as ledger:
            async with ledger.run("payout", owner="user:ada") as run:
                async with run.phase(PhaseKind.CALLING_EXTERNAL):
                    await run.call(stopline.Tool(send, name="send_payout"), "10 EUR")

    anyio.run(main)
    """
)


async def _created(url: str) -> None:
    async with stopline.open(url):
        pass


def _worker_dies_in_flight(url: str) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _DYING_WORKER, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "in flight\n"  # the barrier: its call is out
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0


def test_reconcile_reports_what_its_own_open_recovered_and_sent_to_review(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_created, url)
    _worker_dies_in_flight(url)

    done = stopline_cli("reconcile", "--json", ledger=url)
    summary = as_json(done)
    [op_id] = summary["needs_review"]
    assert op_id.endswith(":send_payout")
    assert summary["recovered"] == [op_id]
    assert summary["checked"] == 1
    assert done.returncode == EXIT_NEEDS_REVIEW, done.stderr

    listed = as_json(stopline_cli("review", "list", "--json", ledger=url))
    assert [item["operation"]["id"] for item in listed] == [op_id]  # as the ledger holds

    again = stopline_cli("reconcile", ledger=url)  # reported once: nothing left to do
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing to do" in again.stdout


@pytest.mark.parametrize("command", ["runs", "stats"])
def test_an_empty_since_is_a_usage_error_not_every_run(tmp_path: Path, command: str) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_created, url)
    done = stopline_cli(command, "--since", "", ledger=url)
    assert done.returncode == EXIT_USAGE, done.stdout + done.stderr
    assert "bad age ''" in done.stderr
    assert "Traceback" not in done.stderr


def test_ctrl_c_on_reconcile_names_where_what_went_to_review_is(pg_url: str) -> None:
    """Ctrl-C may stop a reconcile after its open sent calls to review: the line said
    "`stopline reconcile` goes on from there", which then says "nothing to do"."""
    anyio.run(_running, pg_url)
    schema = pg_url.split("schema=")[1].split("&")[0]
    with psycopg.connect(server_url(), autocommit=True) as other:
        other.execute(f'SET search_path = "{schema}"')
        other.execute("BEGIN")
        other.execute("LOCK TABLE operations IN ACCESS EXCLUSIVE MODE")
        with _cli(pg_url + "&retry_for=120", "reconcile") as proc:
            deadline = time.monotonic() + 60  # a guard, not a timing
            while not _waits_for(other.info.backend_pid):  # the statement is on the server
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
            _, err = _ctrl_c_until_it_ends(proc)
        other.execute("ROLLBACK")
    assert proc.returncode == EXIT_PENDING, err
    assert "`stopline review list` shows it" in err
    assert "Traceback" not in err
