"""A call a dead worker left in flight, that nobody can read back, goes to review at once
(R5, S17).

Recovery marked it ``unknown`` and queued a verification, which escalates a call
with no read-back after the budget's first wait. A short-lived process (the CLI:
``stopline cancel``) closed before that: the receipt said "verifying before closing
this run" with nobody verifying, and the run stayed ``settling`` until someone ran
``reconcile``. Now the escalation is written before opening returns.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

import stopline
from stopline import OpStatus, RunState
from stopline.cli import EXIT_NEEDS_REVIEW
from tests.support.killed import run_until_then_kill

pytestmark = pytest.mark.timeout(60)

WORKER = textwrap.dedent("""
    import sys
    import anyio, stopline

    async def deploy(ctx: stopline.CallContext) -> None:
        print("sent", flush=True)
        await anyio.sleep_forever()  # SIGKILL lands here

    async def main() -> None:
        async with stopline.open(sys.argv[1]) as ledger:
            async with ledger.run("deploy", owner="user:1", run_id="run_crash") as run:
                await run.call(stopline.Tool(deploy, name="deploy"), key="v2")

    anyio.run(main)
""")


async def _crash_mid_call(tmp_path: Path, url: str) -> None:
    await run_until_then_kill(tmp_path / "worker.py", WORKER, b"sent", url)


async def test_a_crashed_call_with_no_read_back_is_in_review_once_a_cli_cancel_returns(
    tmp_path: Path, ledger_url: str
) -> None:
    await _crash_mid_call(tmp_path, ledger_url)
    env = {**os.environ, "STOPLINE_LEDGER": ledger_url}
    done = await anyio.run_process(
        [sys.executable, "-m", "stopline.cli", "cancel", "run_crash", "--json"],
        env=env,
        check=False,
    )
    receipt = json.loads(done.stdout)
    assert receipt["headline"] == "needs_review", done.stdout
    assert done.returncode == EXIT_NEEDS_REVIEW, done.stderr
    async with stopline.open(ledger_url) as ledger:
        op = await ledger.backend.get_operation("run_crash/v2")
        assert op.status is OpStatus.NEEDS_REVIEW
        refs = {e.ref for e in op.evidence}
        assert {"crash", "no_verifier"} <= refs
        receipt_now = await ledger.wait_settled("run_crash", timeout=20)
        assert receipt_now.run_state is RunState.NEEDS_REVIEW
