"""A full disk, a read-only file or directory: typed errors, and the writer keeps serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import stopline
from stopline.errors import LedgerFull, LedgerIOError, LedgerReadOnly
from tests.faults.disk import integrity, read_only, tiny_disk
from tests.faults.sqlite_scenarios import (
    ask_on_a_full_disk,
    batched_settle_on_a_full_disk,
    bulk_record_on_a_full_disk,
    committed_beside_a_held_outcome,
    fence_on_a_full_disk,
    fill_mid_run,
    held_outcome,
    open_when_full,
)
from tests.lifecycle.test_tree_cancel import CHILDREN

ROOT = Path(__file__).resolve().parents[2]


def in_child(scenario: str, path: Path) -> dict[str, Any]:
    """Run a scenario in a child process under ``RLIMIT_FSIZE`` (no tmpfs here)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.faults.sqlite_scenarios", scenario, str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=40,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


async def test_disk_full_mid_run_fails_closed_and_recovers(tmp_path: Path) -> None:
    with tiny_disk(tmp_path) as disk:
        if disk is not None:
            seen = await fill_mid_run(disk.path / "ledger.db", disk.fill, disk.free)
            full = {LedgerFull.__name__}
        else:  # a file size limit fails a write with EFBIG, which SQLite calls an I/O error
            seen = in_child("fill_mid_run", tmp_path / "ledger.db")
            full = {LedgerFull.__name__, LedgerIOError.__name__}
    assert len(seen["errors"]) == 3 and set(seen["errors"]) <= full
    assert seen["dispatched_during"] == []  # the gate failed closed: nothing was sent
    assert seen["readable_during"] == "running"  # reads still served; nobody cancelled it
    assert seen["state"] == "completed"  # the work finished once the disk had room
    assert seen["statuses"] == ["committed", "committed"]
    assert seen["integrity"] == "ok"


async def test_an_outcome_the_full_disk_refuses_is_held_and_the_receipt_says_recording(
    tmp_path: Path,
) -> None:
    with tiny_disk(tmp_path) as disk:
        if disk is not None:
            seen = await held_outcome(disk.path / "ledger.db", disk.fill, disk.free)
        else:
            seen = in_child("held_outcome", tmp_path / "ledger.db")
    assert seen["returned"] == {"id": "run_held/x", "value": "x"}  # the workflow got it
    assert seen["recording"] == [True] and "recording" in seen["words"]
    assert not seen["settled_during"]
    assert seen["state"] == "completed" and seen["statuses"] == ["committed"]
    assert seen["integrity"] == "ok"


async def test_a_job_that_commits_beside_a_held_outcome_runs_once(tmp_path: Path) -> None:
    with tiny_disk(tmp_path, size_kb=4096) as disk:
        if disk is not None:
            seen = await committed_beside_a_held_outcome(
                disk.path / "ledger.db", disk.fill, disk.free
            )
        else:
            seen = in_child("committed_beside_a_held_outcome", tmp_path / "ledger.db")
    # in the batch (rolled back with it), then alone (committed), and never again
    assert seen["ran"] == ["small", "small"]
    assert seen["small"] == "small"  # its caller got its result, not a rerun's error
    assert seen["held_while_full"]  # the outcome did not fit: held, not failed
    assert seen["outcome"] == ["outcome"]  # and landed once the disk had room
    assert seen["ids"] == [0, 1, 2]
    assert seen["integrity"] == "ok"


async def test_a_cancel_whose_provider_ask_meets_a_full_disk_returns_and_asks_later(
    tmp_path: Path,
) -> None:
    """cancel() waits for its provider asks to be sent, so an ask that cannot be
    recorded must not hold it: the ask fails typed (a background step, retried), the
    provider is not asked before its request is on record, and is once the disk frees."""
    with tiny_disk(tmp_path) as disk:
        if disk is not None:
            seen = await ask_on_a_full_disk(disk.path / "ledger.db", disk.fill, disk.free)
        else:
            seen = in_child("ask_on_a_full_disk", tmp_path / "ledger.db")
    assert seen["fenced"] == "cancelling"  # the fence was durable before the disk filled
    assert seen["asked_during"] == []  # never asked without the request on record (R14)
    assert seen["ask_error"].startswith((LedgerFull.__name__, LedgerIOError.__name__))
    assert seen["asked_after"] == ["run_ask/x"]  # retried once the disk had room: once
    assert seen["state"] == "cancelled"
    assert seen["provider_cancel"] == "the provider confirmed the cancel"
    assert seen["integrity"] == "ok"


async def test_a_fence_on_a_full_disk_fails_typed_and_cuts_nothing(tmp_path: Path) -> None:
    """The cut rides the fence's commit (ADR 0043): a fence the disk refuses cuts no
    call, and the run goes on until a cancel's fence is durable."""
    with tiny_disk(tmp_path) as disk:
        if disk is not None:
            seen = await fence_on_a_full_disk(disk.path / "ledger.db", disk.fill, disk.free)
        else:
            seen = in_child("fence_on_a_full_disk", tmp_path / "ledger.db")
    assert seen["error"] in (LedgerFull.__name__, LedgerIOError.__name__)
    assert seen["interrupted_during"] is False and seen["state_during"] == "running"
    assert seen["interrupted_after"] is True
    assert seen["state"] == "needs_review"  # the call cut: unknown, and no read-back
    assert seen["statuses"] == ["needs_review"]
    assert seen["integrity"] == "ok"


async def test_a_trees_bulk_record_on_a_full_disk_is_retried_and_records_each_call_once(
    tmp_path: Path,
) -> None:
    """The set-based record of a tree's interrupted calls meets a full disk: it fails
    typed (a background step, retried, nothing else cancelled), and once the disk frees
    every call is recorded once (not per retry) and the tree settles on its read-backs."""
    with tiny_disk(tmp_path) as disk:
        if disk is not None:
            seen = await bulk_record_on_a_full_disk(disk.path / "ledger.db", disk.fill, disk.free)
        else:
            seen = in_child("bulk_record_on_a_full_disk", tmp_path / "ledger.db")
    assert seen["record_error"].startswith((LedgerFull.__name__, LedgerIOError.__name__))
    assert seen["calls"] == seen["lost_calls"] == CHILDREN  # every call recorded...
    assert seen["lost_per_call"] == [1]  # ...once
    assert seen["state"] == "cancelled"
    assert seen["statuses"] == ["not_committed"]  # each read back: it never happened
    assert seen["integrity"] == "ok"


async def test_a_trees_batched_settle_step_on_a_full_disk_is_retried_and_moves_each_run_once(
    tmp_path: Path,
) -> None:
    """The one transaction that moves a cancelled tree's runs together meets a full
    disk: the step fails typed for every run in it (a background step, retried), and
    once the disk frees each run settles, its moves logged once (not per retry)."""
    with tiny_disk(tmp_path) as disk:
        if disk is not None:
            seen = await batched_settle_on_a_full_disk(
                disk.path / "ledger.db", disk.fill, disk.free
            )
        else:
            seen = in_child("batched_settle_on_a_full_disk", tmp_path / "ledger.db")
    assert seen["step_error"].startswith((LedgerFull.__name__, LedgerIOError.__name__))
    assert seen["children"] == CHILDREN
    assert seen["children_states"] == ["cancelled"]
    assert seen["moved_runs"] == CHILDREN + 1  # the children and the root
    assert seen["moves_per_run"] == [("settle", 1), ("settled", 1)]  # each once
    assert seen["state"] == "cancelled"
    assert seen["statuses"] == ["not_committed"]
    assert seen["integrity"] == "ok"


async def test_opening_on_a_full_disk_says_disk_full(tmp_path: Path) -> None:
    with tiny_disk(tmp_path) as disk:
        if disk is not None:
            seen = await open_when_full(disk.path / "ledger.db", disk.fill)
        else:
            seen = in_child("open_when_full", tmp_path / "ledger.db")
    assert seen["error"] in (LedgerFull.__name__, LedgerIOError.__name__)
    assert "rollback" not in seen["message"]
    if seen["error"] == LedgerFull.__name__:
        assert "full" in seen["message"]


async def make_ledger(path: Path) -> None:
    async with (
        stopline.open(f"sqlite:///{path}") as ledger,
        ledger.run("job", owner="u", run_id="run_1"),
    ):
        pass


async def test_read_only_file_is_a_typed_error_and_untouched(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    await make_ledger(path)
    before = path.read_bytes()
    with read_only(path), pytest.raises(LedgerReadOnly) as info:
        async with stopline.open(f"sqlite:///{path}") as ledger:
            await ledger.cancel("run_1", by="u")
    assert str(path) in str(info.value)
    assert path.read_bytes() == before
    assert integrity(path) == "ok"


async def test_read_only_directory_is_a_typed_error(tmp_path: Path) -> None:
    directory = tmp_path / "ledgers"
    directory.mkdir()
    with read_only(directory), pytest.raises(LedgerReadOnly) as info:
        async with stopline.open(f"sqlite:///{directory / 'ledger.db'}"):
            pass
    assert "read-only" in str(info.value)
