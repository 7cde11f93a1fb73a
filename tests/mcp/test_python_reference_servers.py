"""The Python reference servers from PyPI (``mcp-server-time``, ``mcp-server-git``,
pinned in the ``dev`` extra), real, over real stdio, in both protocol eras they serve:
what ``stopline check-mcp`` discovers of them, and ``mcp-server-time`` driven through
``StoplineMCP`` as a user would (``mcp-server-git``'s effects: ``test_git_server.py``).

Neither declares anything of stopline's: only the standard annotations, which the
client does not trust unless told (ADR 0055)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import stopline
from mcp import StdioServerParameters
from stopline import Cause, OpStatus
from stopline.integrations.mcp import StoplineMCP
from tests.mcp.conftest import ROOT, server_env

import mcp_server_git  # noqa: F401  # isort: skip  # the dev extra's; fails here when missing
import mcp_server_time  # type: ignore[import-untyped]  # noqa: F401  # isort: skip

pytestmark = pytest.mark.timeout(60)
ERAS = ["legacy", "2026-07-28", "auto"]
TIME = StdioServerParameters(
    command=sys.executable, args=["-m", "mcp_server_time", "--local-timezone", "UTC"]
)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def check_mcp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stopline.cli", "check-mcp", *args],
        capture_output=True,
        text=True,
        env={**server_env(), "PYTHONPATH": str(ROOT / "src")},
        cwd=ROOT,
        timeout=50,
        check=False,
    )


def declared(report: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    keys = ("readOnlyHint", "idempotentHint", "destructiveHint", "effects", "cancellable")
    return {tool["name"]: tuple(tool[k] for k in keys) for tool in report["tools"]}


@pytest.mark.parametrize(("era", "protocol"), [("auto", "2026-07-28"), ("legacy", "2025-11-25")])
def test_check_mcp_discovers_the_git_server(tmp_path: Path, era: str, protocol: str) -> None:
    """Discovery calls nothing: the tools as the server declares them (its annotations,
    nothing of stopline's), no tasks, no read-back offered; no findings, exit 0."""
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    command = [sys.executable, "-m", "mcp_server_git", "--repository", str(repo)]
    out = check_mcp("--json", "--era", era, "--", *command)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["server"], report["protocol_version"]) == ("mcp-git 2026.10.19", protocol)
    assert (report["tasks"], report["stopline_verify"], report["findings"]) == ("no", False, [])
    read, write = (True, True, False, None, None), (False, False, False, None, None)
    assert declared(report) == {
        "git_status": read,
        "git_diff_unstaged": read,
        "git_diff_staged": read,
        "git_diff": read,
        "git_commit": write,
        "git_add": (False, True, False, None, None),
        "git_reset": (False, True, True, None, None),
        "git_log": read,
        "git_create_branch": write,
        "git_checkout": write,
        "git_show": read,
        "git_branch": read,
    }
    assert report["checked"] == []  # nothing was called
    text = check_mcp("--era", era, "--", *command)
    assert text.returncode == 0
    assert "read-back   none offered" in text.stdout
    assert text.stdout.rstrip().endswith("result: no findings")


def test_check_mcp_discovers_the_time_server() -> None:
    out = check_mcp("--json", "--", TIME.command, *TIME.args)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["server"] == "mcp-time 2026.10.19"
    assert declared(report) == {
        "get_current_time": (True, True, False, None, None),
        "convert_time": (True, True, False, None, None),
    }
    assert (report["checked"], report["findings"], report["exit"]) == ([], [], 0)


@pytest.mark.parametrize("mode", ERAS)
async def test_the_time_servers_tools_are_gated_unless_its_read_hints_are_trusted(
    ledger: stopline.Ledger, mode: str
) -> None:
    """``readOnlyHint: true`` alone makes no read (ADR 0055): each call passes the gate
    and is recorded ``committed`` with the server's structured answer. Trusted, the same
    calls are reads: sent without the gate, nothing recorded."""
    convert = {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"}
    async with (
        StoplineMCP(TIME, mode=mode, name="time") as gated,
        ledger.run("time", owner="user:1", run_id=f"gated-{mode}") as run,
    ):
        now = await gated.call(run, "get_current_time", {"timezone": "UTC"}, key="now")
        converted = await gated.call(run, "convert_time", convert, key="convert")
    assert (now["timezone"], now["is_dst"]) == ("UTC", False)
    assert converted["target"]["datetime"].endswith("T21:00:00+09:00")
    assert converted["time_difference"] == "+9.0h"
    ops = await ledger.backend.operations(f"gated-{mode}")
    assert [(op.tool, op.status, op.evidence[0].ref) for op in ops] == [
        ("time/get_current_time", OpStatus.COMMITTED, "gate"),
        ("time/convert_time", OpStatus.COMMITTED, "gate"),
    ]
    assert ops[1].result == converted
    async with (
        StoplineMCP(TIME, mode=mode, name="time", trust_read_hints=True) as reads,
        ledger.run("time", owner="user:1", run_id=f"reads-{mode}") as run,
    ):
        again = await reads.call(run, "convert_time", convert)
    assert again == converted
    assert await ledger.backend.operations(f"reads-{mode}") == []


async def test_a_time_server_refusal_is_a_tool_error_that_proves_nothing(
    ledger: stopline.Ledger,
) -> None:
    """An unknown zone fits the listed schema (a string) and the server refuses it as a
    tool error: gated, that is ``NoAnswer`` (``server_error``), ``unknown``, and with
    nothing to read it back, a reviewer's; trusted as a read, ``NoAnswer`` alone."""
    async with (
        StoplineMCP(TIME, name="time") as gated,
        ledger.run("time", owner="user:1", run_id="refused") as run,
    ):
        with pytest.raises(stopline.NoAnswer, match="Invalid timezone") as caught:
            await gated.call(run, "get_current_time", {"timezone": "Mars/Olympus"}, key="k")
    assert caught.value.cause is Cause.SERVER_ERROR
    receipt = await ledger.wait_settled("refused", timeout=20)
    (line,) = receipt.lines
    assert (line.status, [e.ref for e in line.evidence][:2]) == (
        OpStatus.NEEDS_REVIEW,
        ["gate", "server_error"],
    )
    async with (
        StoplineMCP(TIME, name="time", trust_read_hints=True) as reads,
        ledger.run("time", owner="user:1", run_id="read-refused") as run,
    ):
        with pytest.raises(stopline.NoAnswer, match="Invalid timezone"):
            await reads.call(run, "get_current_time", {"timezone": "Mars/Olympus"})
    assert await ledger.backend.operations("read-refused") == []
