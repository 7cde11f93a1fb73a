"""R14 for a paused run (ADR 0066): its recovery line says what a resume sends again, and
following it, the CLI's command, then the application's re-entry, does exactly that.

A worker process runs ``pay`` (completed), ``transfer`` (refused before it committed)
and ``notify`` (its answer lost, no read-back: in review), pauses its run and dies.
The line said only "can be resumed by a principal allowed to resume": not which
calls a re-entry sends again (``transfer``, under the same key) and which it keeps
(``pay`` is returned from the ledger; ``notify``, which may have happened, is not
sent until a read-back or a reviewer proves it did not).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import stopline
from stopline import OpStatus, RunState
from stopline.cli import EXIT_OK
from stopline.errors import OperationInDoubt
from stopline.runtime.tool import Rejected
from tests.surfaces.test_cli import stopline_cli
from tests.truth.advice_paused_worker import run_workflow

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


def paused_by_a_worker_that_died(url: str, run_id: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.truth.advice_paused_worker", url, run_id],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


async def receipt_of(url: str, run_id: str) -> stopline.Receipt:
    async with stopline.open(url) as ledger:
        return await ledger.receipt(run_id)


async def reenter(url: str, run_id: str) -> list[str]:
    """The application re-enters the run with the same run id; returns the keys sent."""
    sent: list[str] = []
    async with stopline.open(url) as ledger:
        with pytest.raises(OperationInDoubt) as doubt:
            async with ledger.run("job", owner="user:1", run_id=run_id) as run:
                await run_workflow(run, sent, worker=False)
        assert doubt.value.op_id == f"{run_id}/notify"  # kept: it may have happened
        pay = await ledger.backend.get_operation(f"{run_id}/pay")
        transfer = await ledger.backend.get_operation(f"{run_id}/transfer")
    assert (pay.status, pay.attempts) == (OpStatus.COMMITTED, 1)
    assert (transfer.status, transfer.attempts) == (OpStatus.COMMITTED, 2)
    return sent


def test_a_paused_runs_line_says_what_a_resume_sends_again(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    paused_by_a_worker_that_died(url, "p")

    receipt = anyio.run(receipt_of, url, "p")
    assert receipt.run_state is RunState.PAUSED
    assert [line.status for line in receipt.lines] == [
        OpStatus.COMMITTED,
        OpStatus.NOT_COMMITTED,
        OpStatus.NEEDS_REVIEW,
    ]
    rule = receipt.resume_rule
    assert rule.startswith("resume with ledger.resume(run_id, by=...), then re-enter the run")
    assert "1 completed action is returned from the ledger, not repeated" in rule
    assert (
        "1 action that never happened is sent when the workflow reaches it, with the same "
        "key ('p/transfer')" in rule
    )
    assert (
        "1 action that may have happened ('p/notify') is not sent again until a read-back "
        "or a reviewer proves it did not happen" in rule
    )
    advice = receipt.advice
    assert (advice.replayed, advice.sent, advice.held) == (
        ("p/pay",),
        ("p/transfer",),
        ("p/notify",),
    )

    # the CLI says the same in its own terms: its command, which does it
    shown = stopline_cli("show", "p", ledger=url)
    (said,) = [line for line in shown.stdout.splitlines() if line.startswith("  resume: ")]
    assert "resume with `stopline resume p`, then re-enter the run from your application" in said
    assert "ledger." not in said
    assert said.endswith(rule[rule.index(": 1 completed") :])  # what it repeats, the same
    resumed = stopline_cli("resume", "p", ledger=url)
    assert resumed.returncode == EXIT_OK, resumed.stderr

    # followed: only what it said is sent again, under its key; nothing else is repeated
    assert anyio.run(reenter, url, "p") == ["p/transfer"]


async def test_a_paused_runs_line_reads_its_children_that_ended(ledger: stopline.Ledger) -> None:
    """A child that completed on its own replays when its paused parent is re-entered: its
    call that never happened raises ``RunEnded`` when reached, and is not sent. The
    paused line did not read the tree's runs, so it would have counted that call as
    sent when the workflow reaches it."""
    waiting = anyio.Event()

    @stopline.tool
    async def refused(ctx: stopline.CallContext, n: int) -> str:
        raise Rejected("no", ref="x")

    @stopline.tool
    async def later(ctx: stopline.CallContext, n: int) -> str:
        return "done"

    async def parent() -> None:
        async with ledger.run("parent", owner="user:1", run_id="pt") as run:
            async with run.child("sub") as sub:
                with pytest.raises(Rejected):
                    await sub.call(refused, 1, key="refused")
            await ledger.pause(run.id, by="user:1")
            waiting.set()
            await run.call(later, 2, key="later")  # waits at the gate until resumed

    async with anyio.create_task_group() as tg:
        tg.start_soon(parent)
        await waiting.wait()
        receipt = await ledger.receipt("pt")
        await ledger.resume("pt", by="user:1")  # the waiting workflow goes on by itself

    assert receipt.run_state in (RunState.PAUSED, RunState.PAUSING)
    assert (await ledger.backend.get_run("pt:sub")).state is RunState.COMPLETED
    rule = receipt.resume_rule
    assert "0 actions that never happened are sent" in rule
    assert (
        "1 action of child runs that ended on their own is not sent again: a call that never "
        "happened in a child run that completed ('pt:sub') raises RunEnded when reached" in rule
    )
    assert receipt.advice.sent == ()
