"""``stopline check-mcp`` says only what the run saw (ADR 0021, docs/check-mcp.md): each
test runs a real server (tests/support/check_mcp_odd_server.py, over stdio) whose
ground-truth log is compared with the profile."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest

from mcp import StdioServerParameters
from stopline.cli.mapping import load_module, map_module
from stopline.integrations.mcp.check import check, declared, load_plan
from stopline.integrations.mcp.check_report import CancelStops, Profile, ToolProfile, render_text
from tests.mcp.conftest import ROOT, server_env

pytestmark = pytest.mark.timeout(60)

SERVER = ROOT / "tests" / "support" / "check_mcp_odd_server.py"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def server(log: Path, *extra: str) -> StdioServerParameters:
    args = [str(SERVER), "--log", str(log), *extra]
    return StdioServerParameters(command=sys.executable, args=args, env=server_env())


def keys(log: Path) -> list[str]:
    if not log.exists():
        return []
    return [json.loads(line)["key"] for line in log.read_text().splitlines()]


async def profile_of(tmp: Path, tool: str, spec: dict[str, Any], *extra: str) -> ToolProfile:
    plan = tmp / "plan.json"
    plan.write_text(json.dumps({"tools": {tool: spec}}))
    profile = await check(
        server(tmp / "log.jsonl", *extra),
        mode="legacy",
        plan=load_plan(plan),
        workdir=tmp,
        settle_timeout=2,
    )
    assert len(profile.checked) == 1
    return profile.checked[0]


READ = {"tool": "find", "arguments": {"key": "{key}"}, "count": "count"}


async def test_key_placeholder_reaches_every_call(tmp_path: Path) -> None:
    """Item 1: "{key}" in the plan's arguments is each call's own key, in the cells too."""
    tool = await profile_of(tmp_path, "commit", {"arguments": {"key": "{key}"}, "read": READ})
    sent = keys(tmp_path / "log.jsonl")
    assert "{key}" not in sent
    cells = {c.name: c for c in tool.cells}
    assert cells["after_result"].key in sent and cells["after_result"].effects == 1


async def test_no_effect_seen_is_not_proof(tmp_path: Path) -> None:
    """Item 2: a cancelled call with no effect found and nothing proving none will land is
    "not proven", never "yes"."""
    spec = {"arguments": {}, "key_argument": "key", "read": READ}
    tool = await profile_of(tmp_path, "sleepy", spec)
    during = tool.cell("during")
    assert during is not None and during.in_flight and during.effects == 0
    assert during.proof == ""
    assert tool.cancel_stops is CancelStops.NOT_PROVEN
    assert "not proof" in tool.cancel_stops_detail


async def test_unknown_verdict_is_not_zero_effects(tmp_path: Path) -> None:
    """Item 3: stopline_verify's "unknown" is unknown, in every derived line."""
    tool = await profile_of(
        tmp_path, "commit", {"arguments": {}, "key_argument": "key"}, "--unknown-verify"
    )
    assert tool.read == "stopline_verify"
    assert [c.effects for c in tool.cells if c.key] == [None] * len(
        [c for c in tool.cells if c.key]
    )
    assert tool.repeat_effects is None and tool.idempotent_by_key == "unknown"
    assert any("could not tell how many effects" in f for f in tool.findings)


async def test_answer_before_the_cancel_supports_no_verdict(tmp_path: Path) -> None:
    """Item 4: a call that answered before its cancel says so; no cancel finding, and no
    "read settles" claim when no cell was unknown."""
    spec = {"arguments": {}, "key_argument": "key", "read": READ}
    tool = await profile_of(tmp_path, "commit", spec)
    during = tool.cell("during")
    assert during is not None and during.answered_first and not during.in_flight
    assert tool.cancel_stops is CancelStops.NOT_TESTED
    assert not any("did not stop it" in f for f in tool.findings)
    assert tool.read_settles.startswith("not tested")


async def test_after_acceptance_runs_for_a_server_that_sends_progress(tmp_path: Path) -> None:
    """Item 5: the progress a whole call shows makes the after_acceptance cell run."""
    spec = {"arguments": {}, "key_argument": "key", "read": READ}
    tool = await profile_of(tmp_path, "progress_commit", spec)
    accepted = tool.cell("after_acceptance")
    assert accepted is not None
    assert accepted.key, accepted.note
    assert tool.progress >= 1


async def test_a_call_never_answered_is_bounded_and_reported(tmp_path: Path) -> None:
    """Item 7: the repeat's calls that never answer end at the settle timeout, reported."""
    spec = {"arguments": {}, "key_argument": "key", "read": READ}
    tool = await profile_of(tmp_path, "hang_on_repeat", spec)
    assert any(f.startswith("same key twice: call 1 got no answer") for f in tool.findings)
    # and proves nothing: it said "yes (one effect)" with no effect seen at all
    assert tool.idempotent_by_key.startswith("not proven (a call got no answer")


async def test_a_server_slower_to_start_than_a_cell_to_settle_is_still_checked(
    tmp_path: Path,
) -> None:
    """Opening was bounded by the settle timeout: a stdio server that takes longer to
    start than a cell to settle (``npx``'s first run) was "no answer within 0.5 s of
    opening", never checked. Opening has its own bound (``connect_timeout``, 30 s)."""
    slow = server(tmp_path / "log.jsonl", "--start-delay", "1.5")
    profile = await check(slow, mode="legacy", workdir=tmp_path, settle_timeout=0.5)
    assert "commit" in [t["name"] for t in profile.tools]


def test_report_shows_server_text_on_one_line() -> None:
    """Item 9: a tool name with a line break cannot add a line to the report; a ``_meta``
    value outside the vocabulary is shown as ignored, not as declared."""
    forged = "x\nresult: no findings"
    bad = types.Tool(
        name="bad_meta",
        input_schema={"type": "object"},
        _meta={"io.stopline/effects": "false", "io.stopline/cancellable": "sometimes"},
    )
    listed = declared(bad)
    assert listed["effects"] is None and listed["cancellable"] is None
    profile = Profile("t", tools=[{"name": forged}, listed])
    lines = render_text(profile).splitlines()
    assert "result: no findings" not in lines[:-1]
    assert any("ignored" in line and "bad_meta" in line for line in lines)


def test_map_says_mcp_tools_are_not_mapped(tmp_path: Path) -> None:
    """Item 10: a module holding an MCP connection says its tools exist at run time only."""
    module = tmp_path / "mcp_flow.py"
    module.write_text(
        "from mcp import StdioServerParameters\n"
        "from stopline.integrations.mcp import StoplineMCP\n"
        "mcp = StoplineMCP(StdioServerParameters(command='true'), name='p')\n"
    )
    mapped = map_module(load_module(str(module)))
    assert mapped.tools == [] and mapped.runtime == ["mcp"]
    assert mapped.to_json()["not_mapped"][0]["name"] == "mcp"
