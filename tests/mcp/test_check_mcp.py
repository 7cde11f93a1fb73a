"""``stopline check-mcp`` reports the right profile for servers whose behaviour is known:
the third-party-style server (tests/support/thirdparty_mcp_server.py: cancellable,
uncancellable, late answer; idempotent by key or, with ``--no-dedupe``, not) with and
without a read tool, and stopline's own testing server (``stopline_verify``, tasks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stopline.integrations.mcp.check import PlanError, check, load_plan
from stopline.integrations.mcp.check_report import Exit, Profile, ToolProfile, render_text
from tests.mcp.conftest import ROOT, server_env, stdio_params
from tests.support import thirdparty_mcp_server as thirdparty

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def thirdparty_plan(tmp: Path, *tools: str, read: bool = True) -> Path:
    """A plan for the third-party server's payment tools, held at its 50% point."""
    spec: dict[str, Any] = {}
    for tool in tools:
        at = {"tool": tool, "at": "50"}
        spec[tool] = {
            "arguments": {"amount": 5},
            "key_argument": "idempotency_key",
            "hold": {
                "before": {"tool": "ctl_hold", "arguments": at},
                "reached": {"tool": "ctl_reached", "arguments": at},
                "release": {"tool": "ctl_release", "arguments": at},
                "ended": {"tool": "ctl_ended", "arguments": {"idempotency_key": "{key}"}},
            },
        }
        if read:
            spec[tool]["read"] = {
                "tool": "find_payment",
                "arguments": {"idempotency_key": "{key}"},
                "count": "count",
            }
    path = tmp / "plan.json"
    path.write_text(json.dumps({"tools": spec}))
    return path


async def profile_of(tmp: Path, *tools: str, read: bool = True, dedupe: bool = True) -> Profile:
    extra = () if dedupe else ("--no-dedupe",)
    server = thirdparty.stdio_params(tmp / "truth.jsonl", *extra)
    plan = load_plan(thirdparty_plan(tmp, *tools, read=read))
    return await check(server, plan=plan, workdir=tmp, settle_timeout=10)


def only(profile: Profile) -> ToolProfile:
    assert len(profile.checked) == 1
    return profile.checked[0]


async def test_check_mcp_read_only_is_discovery(tmp_path: Path) -> None:
    profile = await check(thirdparty.stdio_params(tmp_path / "t.jsonl"), workdir=tmp_path)
    tools = {t["name"]: t for t in profile.tools}
    assert tools["find_payment"]["readOnlyHint"] is True
    assert tools["pay_cancellable"]["readOnlyHint"] is None
    assert (profile.tasks, profile.verify_tool, profile.checked) == ("no", False, [])
    assert profile.exit is Exit.OK
    assert thirdparty.log_entries(tmp_path / "t.jsonl") == []  # nothing was called


@pytest.mark.parametrize("era", ["2026-07-28", "legacy"])
async def test_check_mcp_read_only_sees_stopline_declarations(tmp_path: Path, era: str) -> None:
    profile = await check(stdio_params(tmp_path / "e.db"), mode=era, workdir=tmp_path)
    upload = next(t for t in profile.tools if t["name"] == "upload")
    assert upload["effects"] is True and upload["cancellable"] == "until_accepted"
    assert profile.verify_tool
    if era == "legacy":
        assert profile.tasks.startswith("2025-11-25")
        assert upload["taskSupport"] == "optional"
    else:
        assert profile.tasks.startswith("2026-07-28")


async def test_check_mcp_cancellable_profile(tmp_path: Path) -> None:
    tool = only(await profile_of(tmp_path, "pay_cancellable"))
    during = tool.cell("during")
    assert during is not None and during.effects == 0 and not during.late_answer
    assert tool.cancel_stops == "yes" and tool.answers_after_cancel == "no"
    gate = tool.cell("before_dispatch")
    assert gate is not None and gate.message == "Canceled before external action."
    # stopped, but "not found" from a read tool proves nothing: stopline says so
    assert during.message == "Status unknown; human review required."
    assert any(f.startswith("during: stopline cannot prove") for f in tool.findings)
    assert tool.idempotent_by_key == "yes (one effect)"


async def test_check_mcp_uncancellable_profile(tmp_path: Path) -> None:
    tool = only(await profile_of(tmp_path, "pay_uncancellable"))
    during = tool.cell("during")
    assert during is not None and during.effects == 1 and during.status == "committed"
    assert tool.cancel_stops == "no"
    assert tool.read_settles == "yes"  # the read tool found the effect: committed, proven
    assert not tool.findings


async def test_check_mcp_late_answer_profile(tmp_path: Path) -> None:
    tool = only(await profile_of(tmp_path, "pay_late"))
    during = tool.cell("during")
    assert during is not None and during.late_answer and during.status == "committed"
    assert tool.answers_after_cancel == "yes" and tool.cancel_stops == "no"


async def test_check_mcp_not_idempotent_by_key(tmp_path: Path) -> None:
    tool = only(await profile_of(tmp_path, "pay_uncancellable", dedupe=False))
    assert tool.repeat_effects == 2
    assert tool.idempotent_by_key == "no (two effects)"
    assert any("two effects" in f for f in tool.findings)


async def test_check_mcp_without_a_read_tool(tmp_path: Path) -> None:
    tool = only(await profile_of(tmp_path, "pay_uncancellable", read=False))
    assert [c.effects for c in tool.cells] == [0, None, None, None]  # only the gate is certain
    assert tool.cancel_stops == "unknown" and tool.idempotent_by_key == "unknown"
    assert tool.read_settles == "no read tool"
    during = tool.cell("during")
    assert during is not None and during.status == "needs_review"
    assert any(f.startswith("no read tool") for f in tool.findings)


async def test_check_mcp_stopline_server_scores_clean(tmp_path: Path) -> None:
    """stopline's own server: stopline_verify settles every cell; no findings."""
    point = {"point": "received:upload"}
    plan = tmp_path / "plan.toml"
    plan.write_text(
        "[tools.upload]\n"
        'arguments = { payload = "report" }\n'
        "[tools.upload.hold]\n"
        f'before = {{ tool = "ctl_hold", arguments = {{ point = "{point["point"]}" }} }}\n'
        f'reached = {{ tool = "ctl_reached", arguments = {{ point = "{point["point"]}" }} }}\n'
        f'release = {{ tool = "ctl_release", arguments = {{ point = "{point["point"]}" }} }}\n'
    )
    # every cell settles by a read-back, never by waiting out the bound: a longer bound
    # costs nothing here, and a loaded machine's slow read no longer ends a cell unknown
    profile = await check(
        stdio_params(tmp_path / "e.db"), plan=load_plan(plan), workdir=tmp_path, settle_timeout=30
    )
    tool = only(profile)
    assert tool.read == "stopline_verify"
    statuses = {c.name: c.status for c in tool.cells}
    assert statuses["during"] == "not_committed" and statuses["after_result"] == "committed"
    assert tool.cancel_stops == "yes" and tool.idempotent_by_key == "yes (one effect)"
    assert tool.findings == [] and profile.exit is Exit.OK
    assert "result: no findings" in render_text(profile)


async def test_check_mcp_over_streamable_http(tmp_path: Path) -> None:
    """On 2026 HTTP a cancel closes the request's stream: no answer can come after it.
    A plain ``def`` tool cannot be stopped; the read tool proves its commit."""
    plan = load_plan(thirdparty_plan(tmp_path, "pay_sync"))
    with thirdparty.http_server(tmp_path / "truth.jsonl") as url:
        profile = await check(url, plan=plan, workdir=tmp_path, settle_timeout=10)
    tool = only(profile)
    during = tool.cell("during")
    assert during is not None and during.status == "committed" and not during.late_answer
    assert during.effects == 1 and tool.cancel_stops == "no"
    accepted = tool.cell("after_acceptance")  # a def tool reports no progress: no such moment
    assert accepted is not None and accepted.note.startswith("no sign of acceptance")


def test_check_mcp_plan_errors_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"tools": {"pay": {"read": {"tool": "find_payment"}}}}))
    with pytest.raises(PlanError, match=r"tools.pay.read: name the result's 'count' or 'found'"):
        load_plan(bad)
    bad.write_text("{}")
    with pytest.raises(PlanError, match="expected a 'tools' table"):
        load_plan(bad)


def test_check_mcp_without_a_server_says_so() -> None:
    """An empty target was started as a command: "cannot check : PermissionError"."""
    done = _cli("")
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        "no server given: a Streamable HTTP URL, or -- COMMAND [ARGS...]"
    )
    nan = _cli("--settle-timeout", "nan", "--", "true")  # failed a cell, after its call
    assert nan.returncode == 2
    assert nan.stderr.strip().endswith("invalid --settle-timeout: nan: must be 0 or more seconds")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**server_env(), "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "stopline.cli", "check-mcp", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=50,
        check=False,
    )


def test_check_mcp_cli_json_and_exit_codes(tmp_path: Path) -> None:
    server = thirdparty.stdio_params(tmp_path / "truth.jsonl")
    command = ["--", server.command, *server.args]
    read_only = _cli("--json", *command)
    assert read_only.returncode == Exit.OK, read_only.stderr
    assert json.loads(read_only.stdout)["checked"] == []

    plan = thirdparty_plan(tmp_path, "pay_cancellable")
    profiled = _cli("--json", "--plan", str(plan), *command)
    assert profiled.returncode == Exit.FINDINGS, profiled.stderr
    report = json.loads(profiled.stdout)
    assert report["exit"] == 1 and report["checked"][0]["cancel_stops"] == "yes"

    text = _cli("--plan", str(plan), *command)
    assert text.returncode == Exit.FINDINGS
    assert "pay_cancellable: read-back via find_payment" in text.stdout

    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({"tools": {"no_such_tool": {}}}))
    refused = _cli("--plan", str(missing), *command)
    assert refused.returncode == Exit.ERROR
    assert "the plan names tools the server does not list: no_such_tool" in refused.stderr


def test_check_mcp_cli_stdio_command_must_exist(tmp_path: Path) -> None:
    out = _cli("--", str(tmp_path / "no-such-server"))
    assert out.returncode == Exit.ERROR and "cannot check" in out.stderr
