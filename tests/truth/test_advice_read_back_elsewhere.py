"""ADR 0087: a cancelled run waits for a call in doubt that only a read-back settles, and
only a process with that call's tool registered can read it back. The wait step says so,
in each surface's terms, and following it settles the run.

Before: after the worker holding the call was gone, ``stopline cancel`` printed "wait
until it settles (`stopline cancel RUN --wait` waits for it ...)": that command has no
tools, so its wait could never end by itself, and nothing said who could end it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from starlette.testclient import TestClient

import stopline
from stopline import Headline, ReadBack, RunState, Verdict
from stopline.cli import EXIT_OK, EXIT_PENDING
from stopline.console.app import ConsoleConfig, create_app
from tests.surfaces.test_advice_console import TOKEN, recovery
from tests.surfaces.test_cli import as_json, stopline_cli

pytestmark = pytest.mark.timeout(120)

RUN, OP = "run_left", "run_left/deploy"


# A worker that gates a verifiable call, says so, and is killed while it is in flight.
WORKER = """
import sys, anyio, stopline
from stopline import ReadBack, Verdict

@stopline.tool(name="deploy")
async def deploy(ctx: stopline.CallContext) -> str:
    print("in flight", flush=True)
    await anyio.sleep_forever()
    return "deployed"

@deploy.verifier
async def _(ctx: stopline.CallContext) -> ReadBack:
    return ReadBack(Verdict.UNKNOWN)

async def main() -> None:
    async with stopline.open(sys.argv[1]) as ledger:
        async with ledger.run("deploy", owner="user:cyd", run_id=sys.argv[2]) as run:
            await run.call(deploy, key="deploy")

anyio.run(main)
"""


def killed_in_flight(url: str) -> None:
    """The worker is killed (SIGKILL) once its call is sent: its answer is lost."""
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, url, RUN], stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline() == "in flight\n"  # the barrier: the call is out
    finally:
        worker.kill()
        worker.wait(timeout=30)
        if worker.stdout is not None:
            worker.stdout.close()


def deploy_tool(reads: list[str]) -> stopline.Tool[str]:
    @stopline.tool(name="deploy")
    async def deploy(ctx: stopline.CallContext) -> str:
        raise AssertionError("following the advice must not deploy again")

    @deploy.verifier
    async def _(ctx: stopline.CallContext) -> ReadBack:
        reads.append(ctx.key)
        return ReadBack(Verdict.COMMITTED, ref="deploy-log#7", detail="v2 is live")

    return deploy


async def library_line(url: str) -> str:
    async with stopline.open(url) as ledger:  # no tool "deploy" here either
        return (await ledger.receipt(RUN)).resume_rule


async def reconcile_with_the_tool(url: str, reads: list[str]) -> stopline.Receipt:
    async with stopline.open(url) as ledger:
        await ledger.reconcile(tools=[deploy_tool(reads)])
        return await ledger.wait_settled(RUN, timeout=30)


def test_the_wait_names_who_reads_back_and_following_it_settles(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    killed_in_flight(url)

    cancelled = stopline_cli("cancel", RUN, "--json", ledger=url)
    assert cancelled.returncode == EXIT_PENDING, cancelled.stderr
    receipt = as_json(cancelled)
    assert receipt["headline"] == Headline.VERIFYING.value
    assert receipt["advice"]["steps"] == [{"do": "wait", "run_id": RUN, "op_ids": [OP]}]
    line = receipt["resume_rule"]
    assert line.startswith(f"wait until it settles (`stopline cancel {RUN} --wait` waits for it")
    assert (
        f"; '{OP}' is read back only by a process that has its tool registered: a worker "
        "of your application opened with it, or `ledger.reconcile(tools=[...])` in one; "
        "not this command;" in line
    )

    said = anyio.run(library_line, url)
    assert said.startswith("wait until it settles (ledger.wait_settled); ")
    assert "a ledger opened with it (a worker, or ledger.reconcile(tools=[...]))" in said

    app = create_app(ConsoleConfig(url=url, token=TOKEN))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get(f"/?token={TOKEN}&name=ada")
        page = recovery(client.get(f"/runs/{RUN}").text)
    assert page.startswith("wait until it settles (this page follows it); ")
    assert "a worker of your application opened with it; not the console" in page

    # following it: a process with the tool reads the call back; nothing is sent again
    reads: list[str] = []
    settled = anyio.run(reconcile_with_the_tool, url, reads)
    assert reads == [OP]
    assert settled.run_state is RunState.CANCELLED
    assert settled.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    shown = stopline_cli("show", RUN, "--json", ledger=url)
    assert shown.returncode == EXIT_OK, shown.stderr
    assert "read back only by" not in as_json(shown)["receipt"]["resume_rule"]


def test_a_wait_for_a_call_still_in_flight_names_no_read_back(tmp_path: Path) -> None:
    """A call whose worker is alive settles when its tool answers: the wait names no
    operation, and says nothing of read-backs."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"

    async def go() -> stopline.Receipt:
        release = anyio.Event()
        entered = anyio.Event()

        @stopline.tool
        async def slow(ctx: stopline.CallContext) -> str:
            entered.set()
            await release.wait()
            return "done"

        async with stopline.open(url) as ledger:
            async with ledger.run("job", owner="u") as run, anyio.create_task_group() as tg:
                tg.start_soon(run.call, slow)
                await entered.wait()
                receipt = await ledger.cancel(run.id, by="u")
                release.set()
            return receipt

    receipt = anyio.run(go)
    assert [(s.do.value, s.op_ids) for s in receipt.advice.steps] == [("wait", ())]
    assert "read back only by" not in receipt.resume_rule
