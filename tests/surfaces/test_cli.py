"""The ``stopline`` command against a real SQLite ledger, one subprocess per command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from stopline.cli import (
    EXIT_ERROR,
    EXIT_NEEDS_REVIEW,
    EXIT_NOTHING_TO_DO,
    EXIT_OK,
    EXIT_PENDING,
    EXIT_USAGE,
)
from stopline.domain.model import Evidence, OperationSpec
from stopline.domain.vocab import Cancellable, Cause, OpEvent
from stopline.ledger.backend import OutcomeUpdate, RunSpec
from tests.surfaces.seed import Seeded, seed


def stopline_cli(
    *args: str, ledger: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    full_env.pop("STOPLINE_LEDGER", None)
    if ledger is not None:
        full_env["STOPLINE_LEDGER"] = ledger
    return subprocess.run(
        [sys.executable, "-m", "stopline.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=60,
        check=False,
    )


def as_json(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.stderr == "" or "Traceback" not in done.stderr, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Seeded]:
    url = f"sqlite:///{tmp_path_factory.mktemp('cli') / 'ledger.db'}"
    return url, anyio.run(seed, url)


def test_runs_lists_every_run_with_its_headline(seeded: tuple[str, Seeded]) -> None:
    url, ids = seeded
    done = stopline_cli("runs", "--json", ledger=url)
    assert done.returncode == EXIT_OK
    by_id = {run["id"]: run for run in as_json(done)}
    assert by_id[ids.completed]["headline"] == "completed"
    assert by_id[ids.prevented]["headline"] == "canceled_before_external_action"
    assert by_id[ids.verified]["headline"] == "stopped_with_completed_actions"
    assert by_id[ids.review]["headline"] == "needs_review"
    assert by_id[ids.running]["state"] == "running"
    assert by_id[ids.running]["settled"] is False


def test_runs_filters_by_state_owner_and_age(seeded: tuple[str, Seeded]) -> None:
    url, ids = seeded
    cancelled = as_json(stopline_cli("--ledger", url, "runs", "--state", "cancelled", "--json"))
    assert {run["id"] for run in cancelled} == {ids.prevented, ids.verified}
    bobs = as_json(stopline_cli("runs", "--owner", "user:bob", "--json", ledger=url))
    assert [run["id"] for run in bobs] == [ids.prevented]
    recent = as_json(stopline_cli("runs", "--since", "1h", "--json", ledger=url))
    assert len(recent) == 5
    table = stopline_cli("runs", ledger=url)
    assert ids.running in table.stdout and "needs_review" in table.stdout


def test_show_gives_the_timeline_and_the_receipt(seeded: tuple[str, Seeded]) -> None:
    url, ids = seeded
    data = as_json(stopline_cli("show", ids.verified, "--json", ledger=url))
    kinds = [entry["kind"] for entry in data["timeline"]]
    assert kinds[0] == "run_created"
    assert kinds.index("cancel") < kinds.index("lost") < kinds.index("verified_committed")
    verified = next(e for e in data["timeline"] if e["kind"] == "verified_committed")
    assert verified["evidence"][0]["kind"] == "read_back"
    assert verified["transition"] == "unknown -> committed"
    assert data["receipt"]["headline"] == "stopped_with_completed_actions"
    assert data["receipt"]["cancelled_by"] == "user:ada"
    text = stopline_cli("show", ids.verified, ledger=url).stdout
    assert "Stopped. 1 action had already completed and was kept." in text
    assert "read-back found it committed" in text


def test_cancel_waits_until_settled(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    run_id = anyio.run(_left_running, url, False)
    done = stopline_cli(
        "cancel", run_id, "--reason", "ops says stop", "--by", "ops:kim", "--wait", "--json",
        ledger=url,
    )  # fmt: skip
    assert done.returncode == EXIT_OK, done.stderr
    receipt = as_json(done)
    assert receipt["settled"] is True
    assert receipt["headline"] == "canceled_before_external_action"
    assert receipt["cancelled_by"] == "ops:kim"
    assert receipt["cancel_reason"] == "ops says stop"
    again = stopline_cli("cancel", run_id, "--by", "ops:lee", "--json", ledger=url)
    assert again.returncode == EXIT_OK
    assert as_json(again)["cancelled_by"] == "ops:kim"  # R7: the first cancel stands


def test_cancel_with_an_operation_in_flight_exits_pending(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    run_id = anyio.run(_left_running, url, True)
    done = stopline_cli("cancel", run_id, "--json", ledger=url)
    assert done.returncode == EXIT_PENDING
    # not declared cancellable: its provider is not asked, no confirmation awaited (R14)
    assert as_json(done)["headline"] == "verifying"
    waited = stopline_cli("cancel", run_id, "--wait", "--timeout", "0.2", ledger=url)
    assert waited.returncode == EXIT_PENDING
    assert "verifying before closing this run" in waited.stdout


def test_cancel_of_a_run_in_review_exits_4(seeded: tuple[str, Seeded]) -> None:
    url, ids = seeded
    done = stopline_cli("cancel", ids.review, "--json", ledger=url)
    assert done.returncode == EXIT_NEEDS_REVIEW
    assert as_json(done)["headline"] == "needs_review"


def test_ctrl_c_while_waiting_loses_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    run_id = anyio.run(_left_running, url, True)
    env = {**os.environ, "STOPLINE_LEDGER": url}
    with subprocess.Popen(
        [sys.executable, "-m", "stopline.cli", "cancel", run_id, "--wait", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        anyio.run(_until_cancelled, url, run_id)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_PENDING, err
    assert "Traceback" not in err
    assert "interrupted" in err
    assert json.loads(out)["run_state"] == "cancelling"


def test_review_list_and_show(seeded: tuple[str, Seeded]) -> None:
    url, ids = seeded
    items = as_json(stopline_cli("review", "list", "--json", ledger=url))
    assert [item["run"]["id"] for item in items] == [ids.review]
    op_id = items[0]["operation"]["id"]
    assert items[0]["operation"]["status"] == "needs_review"
    shown = as_json(stopline_cli("review", "show", op_id, "--json", ledger=url))
    kinds = [e["kind"] for e in shown["events"]]
    assert kinds[:2] == ["gate_passed", "accepted"]
    assert "escalated" in kinds
    refs = {e["ref"] for e in shown["operation"]["evidence"]}
    assert "no_verifier" in refs


def test_stats_from_the_event_log(seeded: tuple[str, Seeded]) -> None:
    url, _ = seeded
    data = as_json(stopline_cli("stats", "--json", ledger=url))
    assert data["runs"] == 5
    assert data["outcomes"]["needs_review"] == 1
    assert data["cancel_to_settled"]["settled"] == 3
    assert data["cancel_to_settled"]["p50_seconds"] is not None
    assert data["unknowns"]["total"] == 2
    assert data["unknowns"]["resolved_by"] == {"read_back": 1, "unresolved": 1}
    assert data["unknowns"]["share_read_back"] == 0.5


def test_map_lists_tools_and_gaps(tmp_path: Path) -> None:
    module = tmp_path / "workflow.py"
    module.write_text(
        "import stopline\n"
        "from stopline import Cancellable, PhaseKind\n"
        "from stopline.testing import FakeProvider\n\n"
        "upload = FakeProvider('upload', cancellable=Cancellable.AFTER_ACCEPTED)\n\n"
        "@stopline.tool(effects=False)\n"
        "async def read_report(path: str) -> str:\n"
        "    return path\n\n"
        "@stopline.tool\n"
        "async def notify(ctx: stopline.CallContext, text: str) -> None: ...\n\n"
        "async def workflow(run: stopline.Run) -> None:\n"
        "    async with run.phase(PhaseKind.READING):\n"
        "        await run.call(read_report, 'q3')\n"
        "    async with run.phase(PhaseKind.COMMITTING):\n"
        "        await run.call(upload.tool, 'q3.pdf')\n"
    )
    done = stopline_cli("map", str(module), "--json")
    assert done.returncode == EXIT_OK, done.stderr
    data = as_json(done)
    tools = {t["name"]: t for t in data["tools"]}
    assert tools["read_report"]["effects"] is False and tools["read_report"]["gaps"] == []
    assert tools["upload"]["has_verifier"] is True
    assert tools["upload"]["stop"].startswith("at once")
    assert tools["notify"]["has_verifier"] is False
    assert {g["tool"] for g in data["gaps"]} == {"notify", "upload"}
    assert [p["phase"] for p in data["phases"]] == ["reading", "committing"]
    assert stopline_cli("map", str(module), "--strict").returncode == EXIT_ERROR


def test_errors_are_one_line_without_traceback(tmp_path: Path, seeded: tuple[str, Seeded]) -> None:
    url, _ = seeded
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"this is not a database, not even close" * 100)
    cases = [
        (("show", "run_nope"), url, EXIT_ERROR, "unknown run id 'run_nope'"),
        (("runs",), f"sqlite:///{tmp_path / 'missing.db'}", EXIT_ERROR, "no ledger file"),
        (("runs",), "mysql://nowhere", EXIT_ERROR, "unsupported ledger URL"),
        (("runs",), f"sqlite:///{corrupt}", EXIT_ERROR, "corrupt.db"),
        (("runs", "--since", "3 fortnights"), url, EXIT_USAGE, "bad age"),
        (("runs", "--state", "dancing"), url, EXIT_USAGE, "dancing"),
        (("cancel",), url, EXIT_USAGE, "Missing argument"),
    ]
    # a workflow module that fails as it is imported: one line naming where (tracebacks)
    (tmp_path / "bad.py").write_text("def (:\n")
    (tmp_path / "boom.py").write_text("x = 1\nraise RuntimeError('boom at import')\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")  # exit 3, nothing said
    cases += [
        (("map", str(tmp_path / "bad.py")), url, EXIT_USAGE, "SyntaxError: invalid syntax ("),
        (("map", str(tmp_path / "boom.py")), url, EXIT_USAGE, "boom at import ("),
        (("map", str(tmp_path / "boom.py")), url, EXIT_USAGE, "boom.py, line 2)"),
        (("map", str(tmp_path / "exits.py")), url, EXIT_USAGE, "it called sys.exit(3)"),
    ]
    for args, ledger, code, words in cases:
        done = stopline_cli(*args, ledger=ledger)
        assert done.returncode == code, (args, done.stderr)
        assert "Traceback" not in done.stderr
        assert words in done.stderr, (args, done.stderr)
        if code == EXIT_ERROR or args[0] == "map":
            assert len(done.stderr.strip().splitlines()) == 1


def test_pause_and_resume(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    idle = anyio.run(_left_running, url, False)
    paused = stopline_cli("pause", idle, "--reason", "lunch", "--json", ledger=url)
    assert paused.returncode == EXIT_OK, paused.stderr
    assert as_json(paused)["run_state"] == "paused"
    resumed = stopline_cli("resume", idle, "--json", ledger=url)
    assert resumed.returncode == EXIT_OK, resumed.stderr
    assert as_json(resumed)["run_state"] == "running"
    assert stopline_cli("pause", idle, ledger=url).returncode == EXIT_OK
    said = " ".join(stopline_cli("resume", idle, ledger=url).stdout.split())
    # what the resume leaves to its reader: the workflow goes on, or is re-entered
    assert said.startswith(f"Resumed run {idle}: a workflow still waiting at its gate goes on")
    assert "re-enter the run with the same run id, from the start" in said
    assert "completed actions are returned from the ledger, not repeated" in said


def test_pause_with_a_call_in_flight_exits_pending(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    busy = anyio.run(_left_running, url, True)
    done = stopline_cli("pause", busy, "--json", ledger=url)
    assert done.returncode == EXIT_PENDING, done.stderr
    assert as_json(done)["run_state"] == "pausing"


def test_console_script_and_module_agree() -> None:
    script = Path(sys.executable).parent / "stopline"
    done = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == EXIT_OK
    for command in ("runs", "show", "cancel", "review", "map", "stats", "console", "bench"):
        assert command in done.stdout


# -- helpers --------------------------------------------------------------------------
async def _left_running(url: str, with_operation: bool) -> str:
    """A run as a live (or crashed) worker leaves it: running, maybe with a call in flight."""
    async with stopline.open(url) as ledger:
        run = await ledger.backend.create_run(
            RunSpec(id="run_worker", name="deploy", owner="user:cyd", tenant="default")
        )
        if with_operation:
            await ledger.backend.gate(
                OperationSpec(
                    id="run_worker/1:deploy",
                    run_id=run.id,
                    tool="deploy",
                    args_digest="sha256:0",
                    description="deploy v2 to production",
                    cancellable=Cancellable.NEVER,
                    can_verify=False,
                    can_compensate=False,
                )
            )
        return run.id


async def _until_cancelled(url: str, run_id: str) -> None:
    async with stopline.open(url) as ledger:
        with anyio.fail_after(30):
            while (await ledger.backend.get_run(run_id)).cancelled_at is None:
                await ledger.wait_for_change(run_id)


async def _in_doubt(url: str) -> str:
    """An operation whose answer was lost and that nothing can read back."""
    return (await in_doubt(url, 1))[0]


async def in_doubt(url: str, n: int) -> list[str]:
    """``n`` operations of one run whose answer was lost and that nothing can read back."""
    async with stopline.open(url) as ledger:
        run = await ledger.backend.create_run(
            RunSpec(id="run_doubt", name="pay", owner="user:cyd", tenant="default")
        )
        ids = []
        for i in range(n):
            op_id = f"run_doubt/{i + 1}:pay"
            await ledger.backend.gate(
                OperationSpec(
                    id=op_id,
                    run_id=run.id,
                    tool="pay",
                    args_digest="sha256:0",
                    description="pay the invoice",
                    cancellable=Cancellable.NEVER,
                    can_verify=False,
                    can_compensate=False,
                )
            )
            lost = OutcomeUpdate(OpEvent.LOST, [Evidence.local("timeout")], cause=Cause.TIMEOUT)
            await ledger.backend.record(op_id, lost)
            ids.append(op_id)
        return ids


def test_reconcile_then_review_resolve(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    op_id = anyio.run(_in_doubt, url)
    reconciled = stopline_cli("reconcile", "--json", ledger=url)
    assert reconciled.returncode == EXIT_NEEDS_REVIEW, reconciled.stderr
    queue = as_json(stopline_cli("review", "list", "--json", ledger=url))
    assert [item["operation"]["id"] for item in queue] == [op_id]
    resolved = stopline_cli(
        "review",
        "resolve",
        op_id,
        "--as",
        "committed",
        "--note",
        "bank statement 0412",
        "--by",
        "ops:lee",
        "--json",
        ledger=url,
    )
    # the code of the receipt: the run itself is still running (its worker never ended it)
    assert resolved.returncode == EXIT_PENDING, resolved.stderr
    assert as_json(resolved)["operations"][0]["status"] == "committed"
    assert as_json(stopline_cli("review", "list", "--json", ledger=url)) == []
    shown = as_json(stopline_cli("show", "run_doubt", "--json", ledger=url))
    (line,) = shown["receipt"]["operations"]
    assert line["status"] == "committed"
    assert {"kind": "review", "ref": "ops:lee"} in [
        {k: e[k] for k in ("kind", "ref")} for e in line["evidence"]
    ]


def test_an_empty_ledger_option_is_refused_not_the_default(tmp_path: Path) -> None:
    """``--ledger ""`` opened ``sqlite:///stopline.db``, a ledger the operator did not
    name; it is a usage error now, and nothing is created."""
    env = {"HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "stopline.cli", "--ledger", "", "cancel", "run_x"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "--ledger is empty" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "stopline.db").exists()


async def test_an_empty_ledger_url_is_refused_by_the_library(tmp_path: Path) -> None:
    with pytest.raises(stopline.InvalidInput, match="ledger URL"):
        async with stopline.open(""):
            pass
    with pytest.raises(stopline.InvalidInput, match="ledger URL"):
        async with stopline.open("   "):
            pass


def test_pause_of_a_run_that_ended_has_nothing_to_pause(seeded: tuple[str, Seeded]) -> None:
    """It said "error: illegal transition: event 'pause' in state 'completed'", exit 1."""
    url, ids = seeded
    before = as_json(stopline_cli("show", ids.completed, "--json", ledger=url))
    done = stopline_cli("pause", ids.completed, ledger=url)
    assert done.returncode == EXIT_NOTHING_TO_DO, done.stderr
    assert done.stdout.strip() == f"nothing to pause: run {ids.completed} is completed"
    assert done.stderr == ""
    said = as_json(stopline_cli("pause", ids.completed, "--json", ledger=url))
    assert said == {"run_id": ids.completed, "run_state": "completed", "paused": False}
    assert as_json(stopline_cli("show", ids.completed, "--json", ledger=url)) == before


def test_version_names_the_release_and_the_ledger_schema() -> None:
    """``stopline --version`` did not exist ("No such option"); it needs no ledger, even
    when STOPLINE_LEDGER names one that cannot be opened."""
    from stopline.ledger.schema import SCHEMA_VERSION

    done = stopline_cli("--version", ledger="postgresql://nobody@127.0.0.1:1/none")
    assert done.returncode == EXIT_OK, done.stderr
    assert done.stdout == f"stopline {stopline.__version__} (ledger schema {SCHEMA_VERSION})\n"
