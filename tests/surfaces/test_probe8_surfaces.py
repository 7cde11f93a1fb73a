"""Probe 8 of the operator surfaces: what the CLI and the console say a reviewer may do
before an operation's horizon, when ``cancel --wait`` gives up, and who overruled what.

Before: the recovery line of a run in review offered ``stopline review resolve OP --as
not_committed`` (and the console's queue its "It did not happen" button) while the
ledger refuses that decision, the operation's effect still able to land (R13); ``cancel
--wait --timeout N`` said nothing when N passed; a reviewer's decision read as
"reviewer decided: not committed" with neither the note it rests on nor the recorded
outcome it overrules; a note longer than the ledger keeps was cut silently by the CLI.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from starlette.testclient import TestClient

import stopline
from stopline.cli import EXIT_ERROR, EXIT_NEEDS_REVIEW, EXIT_OK, EXIT_PENDING, EXIT_USAGE
from stopline.console import ConsoleConfig, create_app
from stopline.domain.model import Evidence
from stopline.domain.receipt import horizon_words
from stopline.domain.vocab import EvidenceKind, OpEvent, PhaseKind, Policy
from stopline.ledger.backend import OutcomeUpdate, RunSpec
from tests.surfaces.test_cli import as_json, stopline_cli

pytestmark = pytest.mark.timeout(120)

TOKEN = "probe8-token"
FAST = stopline.VerifyBudget(attempts=2, first_delay=0.01, factor=1.0, max_delay=0.01)
RUN, OP = "run_pay", "run_pay/wire"


# -- seeding: real runs through the runtime ------------------------------------------
async def _in_review(url: str, settles_within: float) -> float:
    """A run cancelled mid-call whose tool declares ``settles_within``: its answer is lost
    (the horizon recorded with it), the read-back cannot tell, and it goes to review.
    Returns the horizon recorded (0 when none is: it had passed)."""
    started = anyio.Event()

    @stopline.tool(settles_within=settles_within, description="wire 500 EUR to supplier")
    async def wire(ctx: stopline.CallContext, amount: int) -> str:
        started.set()
        await anyio.sleep_forever()
        return "never"

    @wire.verifier
    async def look(ctx: stopline.CallContext) -> stopline.ReadBack:
        return stopline.ReadBack(stopline.Verdict.UNKNOWN, detail="the bank did not answer")

    async with stopline.open(url, tools=[wire], verify=FAST) as ledger:

        async def body() -> None:
            async with (
                ledger.run("pay", owner="user:ada", run_id=RUN) as run,
                run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),
            ):
                await run.call(wire, 500, key="wire")

        async with anyio.create_task_group() as tg:
            tg.start_soon(body)
            await started.wait()
            await ledger.cancel(RUN, by="user:ada", reason="wrong amount")
        await ledger.wait_settled(RUN, timeout=30)
        op = await ledger.backend.get_operation(OP)
        assert op.status.value == "needs_review"
        return op.horizon or 0.0  # none recorded once it has passed already (``0``)


async def _contradicted(url: str) -> None:
    """A call whose response proved it committed, then a read-back that finds nothing of
    it: the contradiction sends it to review (``Outcomes.resolve``, as a verdict goes)."""

    @stopline.tool(description="wire 500 EUR to supplier")
    async def wire(ctx: stopline.CallContext, amount: int) -> str:
        return "transfer tx_81"

    async with stopline.open(url, tools=[wire]) as ledger:
        async with ledger.run("pay", owner="user:ada", run_id=RUN) as run:
            await run.call(wire, 500, key="wire")
        seen = Evidence(EvidenceKind.READ_BACK, "bank:statement", "no tx_81 on the statement")
        update = OutcomeUpdate(OpEvent.VERIFIED_NOT_COMMITTED, [seen])
        op = await ledger.core.outcomes.resolve(OP, update)
        assert op.status.value == "needs_review"


def _status(url: str) -> str:
    async def read() -> str:
        async with stopline.open(url) as ledger:
            return (await ledger.backend.get_operation(OP)).status.value

    return anyio.run(read)


def _resume_line(done: subprocess.CompletedProcess[str]) -> str:
    (line,) = [ln for ln in done.stdout.splitlines() if ln.strip().startswith("resume:")]
    return line


# -- 1. review guidance before the horizon (R13, R14) -----------------------------------
@pytest.mark.parametrize("ledger_backend", ["sqlite", "postgres"], indirect=True)
def test_review_guidance_offers_not_committed_only_after_the_horizon(ledger_url: str) -> None:
    """While the effect may still land, every CLI guidance offers ``--as committed`` now
    and ``--as not_committed`` only after the horizon, which the ledger indeed refuses
    until then; the step offered now is taken."""
    horizon = anyio.run(_in_review, ledger_url, 3600.0)
    until = horizon_words(horizon)
    committed = f"`stopline review resolve {OP} --as committed`"
    not_committed = f"`stopline review resolve {OP} --as not_committed`"
    shown = stopline_cli("show", RUN, ledger=ledger_url)
    assert shown.returncode == EXIT_OK, shown.stderr
    line = _resume_line(shown)
    assert f"{committed} if its evidence shows it happened" in line
    assert f"{not_committed} if it did not, only after {until}" in line
    assert f"{committed} or {not_committed}" not in line  # offered now, as before
    advice = as_json(stopline_cli("show", RUN, "--json", ledger=ledger_url))["receipt"]["advice"]
    (step,) = advice["steps"]
    assert (step["do"], step["op_ids"], step["horizon"]) == ("review", [OP], pytest.approx(horizon))

    inspected = stopline_cli("review", "show", OP, ledger=ledger_url)
    assert f"decide: {committed} if its evidence shows it happened" in inspected.stdout
    assert f"local: horizon {until} (" in inspected.stdout  # not bare epoch seconds
    op_json = as_json(stopline_cli("review", "show", OP, "--json", ledger=ledger_url))
    assert op_json["operation"]["horizon"] == pytest.approx(horizon)

    resumed = stopline_cli("resume", RUN, ledger=ledger_url)  # refused: says what first
    assert resumed.returncode == EXIT_ERROR
    assert f"`--as not_committed` only once an operation's effect can no longer land: " \
        f"for one of them, not before {until}" in resumed.stderr  # fmt: skip

    refused = stopline_cli("review", "resolve", OP, "--as", "not_committed", ledger=ledger_url)
    assert refused.returncode == EXIT_ERROR and "may still land until" in refused.stderr
    assert _status(ledger_url) == "needs_review"  # nothing recorded
    taken = stopline_cli("review", "resolve", OP, "--as", "committed", ledger=ledger_url)
    assert taken.returncode == EXIT_OK, taken.stderr
    assert _status(ledger_url) == "committed"


def test_review_guidance_after_the_horizon_offers_both_decisions(tmp_path: Path) -> None:
    """Once the horizon has passed, both decisions are offered and both are taken."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    horizon = anyio.run(_in_review, url, 0.05)
    while time.time() <= horizon:  # a barrier on the clock: the horizon has passed
        time.sleep(0.05)
    line = _resume_line(stopline_cli("show", RUN, ledger=url))
    assert (
        f"`stopline review resolve {OP} --as committed` or "
        f"`stopline review resolve {OP} --as not_committed`, as its evidence shows"
    ) in line
    assert "only after" not in line
    done = stopline_cli("review", "resolve", OP, "--as", "not_committed", ledger=url)
    assert done.returncode == EXIT_OK, done.stderr
    assert _status(url) == "not_committed"


def _console(url: str) -> TestClient:
    return TestClient(create_app(ConsoleConfig(url=url, token=TOKEN)), base_url="http://127.0.0.1")


def test_console_review_form_does_not_offer_it_did_not_happen_before_the_horizon(
    tmp_path: Path,
) -> None:
    """The queue's "It did not happen" is disabled and says until when; the run page's
    recovery line says the same; a forced POST is refused (409), nothing recorded."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    until = horizon_words(anyio.run(_in_review, url, 3600.0))
    with _console(url) as client:
        client.get(f"/?token={TOKEN}&name=kim")
        page = client.get("/review")
        assert page.status_code == 200
        assert re.search(r'value="not_committed" disabled>It did not happen<', page.text)
        assert f"&ldquo;It did not happen&rdquo; only after {until}" in page.text
        run_page = client.get(f"/runs/{RUN}")
        recovery = re.search(r'data-testid="recovery">(.*?)</div>', run_page.text, re.S)
        assert recovery is not None
        assert f"only after {until}" in recovery[1]
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        forced = client.post(
            "/review/run_pay%2Fwire/resolve", data={"csrf": csrf[1], "decision": "not_committed"}
        )
        assert forced.status_code == 409 and "may still land until" in forced.text
        assert _status(url) == "needs_review"
        taken = client.post(
            "/review/run_pay%2Fwire/resolve", data={"csrf": csrf[1], "decision": "committed"}
        )
        assert taken.status_code == 200
    assert _status(url) == "committed"


# -- 2. cancel --wait --timeout: what a wait that gave up says --------------------------
_WORKER = """
import sys
from pathlib import Path
import anyio
import stopline

async def main(url, flag):
    @stopline.tool
    async def charge(ctx: stopline.CallContext, amount: int) -> str:
        Path(flag).write_text(ctx.key)
        await anyio.sleep_forever()
        return "never"

    async with stopline.open(url) as ledger:
        async with ledger.run("checkout", owner="user:w", run_id="run_held") as run:
            await run.call(charge, 1, key="charge")

anyio.run(main, *sys.argv[1:3])
"""


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A ledger whose run ``run_held`` a live worker process holds mid-call."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    flag = tmp_path / "flag"
    process = subprocess.Popen([sys.executable, "-c", _WORKER, url, str(flag)])
    try:
        deadline = time.monotonic() + 60
        while not flag.exists():  # a barrier: the tool wrote it, the call passed the gate
            assert process.poll() is None, "the worker ended before its call"
            assert time.monotonic() < deadline, "the worker's call never started"
            time.sleep(0.05)
        yield url, process
    finally:
        process.kill()
        process.wait()


def test_cancel_wait_that_times_out_says_what_it_waits_on(
    held: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, process = held
    done = stopline_cli("cancel", "run_held", "--wait", "--timeout", "0.3", ledger=url)
    assert done.returncode == EXIT_PENDING
    said = done.stderr
    assert "gave up waiting after 0.3 s: run run_held has not settled yet" in said
    assert "it waits on 1 operation: 'charge' (run_held/charge): sent; no answer yet" in said
    assert f"held by: pid {process.pid}@" in said and ", live" in said
    assert "`stopline cancel run_held --wait` waits again" in said
    again = stopline_cli("cancel", "run_held", "--wait", "--timeout", "0", "--json", ledger=url)
    assert again.returncode == EXIT_PENDING
    assert as_json(again)["settled"] is False  # stdout is the receipt alone
    assert "gave up waiting after 0 s" in again.stderr


def test_cancel_wait_that_settles_says_nothing_of_giving_up(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"

    async def create() -> None:
        async with stopline.open(url) as ledger:
            await ledger.backend.create_run(
                RunSpec(id="run_idle", name="idle", owner="user:a", tenant="default")
            )

    anyio.run(create)
    done = stopline_cli("cancel", "run_idle", "--wait", "--timeout", "5", ledger=url)
    assert done.returncode == EXIT_OK, done.stderr
    assert "gave up" not in done.stderr


# -- 3. a reviewer's overrule, as it happened ----------------------------------------
def _decision_entry(url: str) -> dict[str, Any]:
    timeline = as_json(stopline_cli("show", RUN, "--json", ledger=url))["timeline"]
    (entry,) = [e for e in timeline if e["kind"].startswith("reviewed_")]
    found: dict[str, Any] = entry
    return found


@pytest.mark.parametrize("ledger_backend", ["sqlite", "postgres"], indirect=True)
def test_an_overrule_names_who_decided_on_what_and_what_it_overrules(ledger_url: str) -> None:
    anyio.run(_contradicted, ledger_url)
    note = "bank statement of 7 Dec shows no tx_81"
    done = stopline_cli(
        "review", "resolve", OP, "--as", "not_committed", "--by", "ops:kim", "--note", note,
        ledger=ledger_url,
    )  # fmt: skip
    assert done.returncode == EXIT_OK, done.stderr
    detail = _decision_entry(ledger_url)["detail"]
    assert detail.startswith(f"decided by: ops:kim; note: {note}; ")
    assert "overrules the recorded committed (response proves it committed, " in detail
    assert "as the contradicting read_back:bank:statement (" in detail
    shown = stopline_cli("show", RUN, ledger=ledger_url).stdout
    assert "decided by: ops:kim" in shown and "overrules the recorded committed" in shown
    with _console(ledger_url) as client:
        client.get(f"/?token={TOKEN}")
        page = client.get(f"/runs/{RUN}").text
    assert "decided by: ops:kim; note: bank statement of 7 Dec shows no tx_81" in page


def test_a_decision_that_keeps_the_recorded_outcome_says_so(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_contradicted, url)
    done = stopline_cli("review", "resolve", OP, "--as", "committed", "--by", "ops:lee", ledger=url)
    assert done.returncode == EXIT_OK, done.stderr
    detail = _decision_entry(url)["detail"]
    assert detail.startswith("decided by: ops:lee; no note given; ")
    assert "overrules the contradicting read_back:bank:statement (" in detail
    assert "the recorded committed stands" in detail


def test_a_decision_on_a_lost_answer_overrules_nothing(tmp_path: Path) -> None:
    """Guard: an item in review for want of an answer has no recorded outcome to overrule."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_in_review, url, 0.0)
    done = stopline_cli("review", "resolve", OP, "--as", "not_committed", "--by", "ops:kim",
                        "--note", "no transfer", ledger=url)  # fmt: skip
    assert done.returncode == EXIT_OK, done.stderr
    assert _decision_entry(url)["detail"] == "decided by: ops:kim; note: no transfer"


# -- 4. odd inputs -------------------------------------------------------------------
def test_a_note_longer_than_the_ledger_keeps_is_refused_not_cut(tmp_path: Path) -> None:
    """The CLI cut a long note to the ledger's 4,096 characters, silently, as the
    decision's evidence; now it is a usage error, nothing recorded, as in the console."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_in_review, url, 0.0)
    note = "x" * 5000
    done = stopline_cli("review", "resolve", OP, "--as", "committed", "--note", note, ledger=url)
    assert done.returncode == EXIT_USAGE
    assert "invalid note: 5,000 characters; at most 1,000" in done.stderr
    assert _status(url) == "needs_review"


def test_odd_ids_and_ages_are_typed_errors(tmp_path: Path) -> None:
    """Guard: ids with spaces, unicode or a leading '-' (behind ``--``) are looked up as
    given; odd ages are usage errors; none is a traceback."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_in_review, url, 0.0)
    for args, code, said in (
        (("show", "run x"), EXIT_ERROR, "unknown run id 'run x'"),
        (("show", "rün"), EXIT_ERROR, "unknown run id 'rün'"),
        (("show", "--", "-run"), EXIT_ERROR, "unknown run id '-run'"),
        (("review", "show", "--", "-x"), EXIT_ERROR, "unknown operation id '-x'"),
        (("show", ""), EXIT_USAGE, "must not be empty"),
        (("runs", "--since", "-1h"), EXIT_USAGE, "bad age '-1h'"),
        (("runs", "--since", "inf"), EXIT_USAGE, "bad age 'inf'"),
        (("runs", "--since", "1" + "0" * 400 + "w"), EXIT_OK, RUN),
    ):
        done = stopline_cli(*args, ledger=url)
        assert done.returncode == code, (args, done.stderr)
        assert said in done.stdout + done.stderr, args
        assert "Traceback" not in done.stderr, args


def test_the_console_shows_a_run_of_a_thousand_operations(tmp_path: Path) -> None:
    """Guard: a run of 1,000 operations renders whole in the console and the CLI."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"

    async def bulk() -> None:
        @stopline.tool(description="send item")
        async def send(ctx: stopline.CallContext, i: int) -> int:
            return i

        async with (
            stopline.open(url, tools=[send]) as ledger,
            ledger.run("bulk", owner="user:ada", run_id="run_bulk") as run,
        ):
            for i in range(1000):
                await run.call(send, i, key=f"item-{i}")

    anyio.run(bulk)
    with _console(url) as client:
        client.get(f"/?token={TOKEN}")
        page = client.get("/runs/run_bulk")
    assert page.status_code == 200
    assert page.text.count("<td><bdi>response proves it committed</bdi></td>") == 1000
    shown = as_json(stopline_cli("show", "run_bulk", "--json", ledger=url))
    assert len(shown["operations"]) == 1000
    assert shown["receipt"]["headline"] == "completed"


def test_cancel_of_a_run_in_review_before_its_horizon_exits_4_changing_nothing(
    tmp_path: Path,
) -> None:
    """Guard: ``cancel`` of a run in review exits 4 (needs review), as documented."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_in_review, url, 3600.0)
    done = stopline_cli("cancel", RUN, ledger=url)
    assert done.returncode == EXIT_NEEDS_REVIEW
    assert _status(url) == "needs_review"
