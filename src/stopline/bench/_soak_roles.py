"""The soak's child processes: a worker running workflows, the canceller cancelling them.

A worker counts typed errors (a call or a run block that met a storage
fault) and lets anything else kill it: that is a teardown. When the faults
are over it waits for its runs to settle and checks each against the
contract's rules and against the canceller's record.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import anyio

import stopline
from stopline import Cancellable, Policy, RunState
from stopline.bench._soak_crash import SharedProvider, provider_path
from stopline.bench.soak import CANCELLER
from stopline.domain.receipt import Receipt
from stopline.errors import LedgerError, StoplineError
from stopline.testing import FakeProvider
from stopline.testing.checks import Observed, check

__all__ = ["run"]

_POLICIES = (Policy.IMMEDIATE, Policy.VERIFY, Policy.AT_BOUNDARY)


async def run(role: str, url: str, deadline: float, stop_file: Path, seed: int) -> dict[str, Any]:
    if role == "create":
        async with stopline.open(url):
            return {}
    if role == "canceller":
        return await _canceller(url, deadline)
    if role == "judge":
        providers = _shared(stop_file)
        tools = [p.tool for p in providers.values()]
        return await _with_ledger(url, deadline, _judge_killed, stop_file, providers, tools=tools)
    providers = _shared(stop_file) if role == "crash-worker" else _in_process()
    return await _worker(url, deadline, stop_file, seed, providers)


def _in_process() -> dict[str, FakeProvider]:
    return {
        "send": FakeProvider("send"),
        "pay": FakeProvider("pay", cancellable=Cancellable.NEVER),
    }


def _shared(stop_file: Path) -> dict[str, FakeProvider]:
    """The crash soak's providers: their truth in a file beside ``stop_file``."""
    path = provider_path(stop_file.parent)
    return {name: SharedProvider(name, path) for name in ("send", "pay")}


def _load_truth(providers: dict[str, FakeProvider]) -> None:
    """The shared providers' truth as their file has it now (in-process ones hold theirs)."""
    for provider in providers.values():
        if isinstance(provider, SharedProvider):
            provider.load()


def owner(seed: int) -> str:
    """The owner of a worker's runs (the judge finds a killed worker's runs by it)."""
    return f"soak:worker:{seed}"


async def _with_ledger(
    url: str, deadline: float, work: Any, *args: Any, tools: list[Any] | None = None
) -> dict[str, Any]:
    """``work(ledger, *args)`` on an opened ledger; opening (a write: the worker registers)
    is retried through faults, the work itself is not."""
    budget = stopline.VerifyBudget(attempts=4, first_delay=0.02)
    while True:
        started = False
        try:
            async with stopline.open(url, verify=budget, tools=tools or ()) as ledger:
                started = True
                result: dict[str, Any] = await work(ledger, *args)
            return result
        except StoplineError:
            if started or time.time() > deadline + 60:
                raise
        await anyio.sleep(0.1)


async def _worker(
    url: str, deadline: float, stop_file: Path, seed: int, providers: dict[str, FakeProvider]
) -> dict[str, Any]:
    return await _with_ledger(url, deadline, _work, deadline, stop_file, seed, providers)


async def _work(
    ledger: stopline.Ledger,
    deadline: float,
    stop_file: Path,
    seed: int,
    providers: dict[str, FakeProvider],
) -> dict[str, Any]:
    rng = random.Random(seed)
    counts = {"operations": 0, "typed_errors": 0}
    runs: list[str] = []
    n = 0
    while time.time() < deadline:
        n += 1
        run_id = f"soak_{seed}_{n}"
        try:
            async with ledger.run(
                "soak", owner=owner(seed), run_id=run_id, policy=rng.choice(_POLICIES)
            ) as run:
                runs.append(run_id)
                for step in range(3):
                    provider = providers[rng.choice(("send", "pay"))]
                    try:
                        await run.call(provider.tool, step, key=f"step{step}")
                        counts["operations"] += 1
                    except StoplineError:
                        counts["typed_errors"] += 1
                    await anyio.sleep(rng.uniform(0, 0.02))  # a cancel may land here
        except StoplineError:
            counts["typed_errors"] += 1  # the block's end met a fault (held, retried)
    await _until_exists(stop_file)  # the faults are over when the parent says so
    _load_truth(providers)  # this worker's calls are over
    violations = [v for run_id in runs for v in await _judge(ledger, run_id, providers)]
    return {**counts, "runs": len(runs), "violations": violations}


async def _until_exists(path: Path) -> None:
    """Another process's signal, a file: polled, as nothing here can notify across processes."""
    while not await anyio.Path(path).exists():  # noqa: ASYNC110
        await anyio.sleep(0.05)


async def _judge_killed(
    ledger: stopline.Ledger, stop_file: Path, providers: dict[str, FakeProvider]
) -> dict[str, Any]:
    """Every run of every killed worker (``killed.json`` beside ``stop_file``), once this
    process recovered what they left in flight: opening the ledger swept them (their
    processes are gone) and queued their operations for a read-back here."""
    _load_truth(providers)  # every worker's calls are over
    killed = json.loads((stop_file.parent / "killed.json").read_text())
    runs = [
        run.id
        for seed in killed
        for run in await ledger.backend.list_runs(owner=owner(seed), limit=1_000_000)
    ]
    judged = [await _judge(ledger, run_id, providers, crashed=True) for run_id in runs]
    return {"judged": len(runs), "violations": [v for found in judged for v in found]}


async def _judge(
    ledger: stopline.Ledger,
    run_id: str,
    providers: dict[str, FakeProvider],
    *,
    crashed: bool = False,
) -> list[str]:
    """The contract's rules for one run, once it settled, and who cancelled it. The
    faults are over, but the other workers' writes go on (settling, ending), and with
    the soak's short busy timeout a read may still meet the lock: a storage error is
    read again, within the same 60 s."""
    until = time.monotonic() + 60
    while True:
        try:
            left = until - time.monotonic()
            return await _judged(ledger, run_id, providers, left, crashed)
        except TimeoutError:
            return [f"{run_id}: not settled 60 s after the faults cleared"]
        except stopline.UnknownRun:
            return []  # its creation never committed: a typed error was counted
        except LedgerError as exc:
            if time.monotonic() > until:
                return [f"{run_id}: unreadable 60 s after the faults cleared ({exc!r})"]
            await anyio.sleep(0.05)


async def _judged(
    ledger: stopline.Ledger,
    run_id: str,
    providers: dict[str, FakeProvider],
    timeout: float,
    crashed: bool,
) -> list[str]:
    timeout = max(timeout, 0.001)
    left_open = await _resolved_if_open(ledger, run_id, timeout) if crashed else None
    if left_open is None:
        settled = await ledger.wait_settled(run_id, timeout=timeout)
    record = await ledger.backend.get_run(run_id)
    seen = Observed(
        run=record,
        ops=await ledger.backend.operations(run_id),
        events=await ledger.backend.events(run_id),
        receipt=settled if left_open is None else left_open,
        settled=left_open is None,
        providers=providers,
        settled_receipt=settled if left_open is None else None,
        crashed=crashed,
        recovered=crashed,
    )
    found = [f"{run_id}: {v}" for v in check(seen)[0]]
    if record.cancelled_by not in (None, CANCELLER):
        found.append(f"{run_id}: cancelled by {record.cancelled_by!r}, not the canceller")
    if record.state is RunState.FAILED:
        found.append(f"{run_id}: failed ({record.cancel_reason or 'see its events'})")
    return found


async def _resolved_if_open(ledger: stopline.Ledger, run_id: str, timeout: float) -> Receipt | None:
    """A killed worker's run that nobody cancelled stays open (a resume would carry it
    on): its receipt once every line is resolved. ``None`` for a run that ended or was
    cancelled (it settles as any run does)."""
    with anyio.fail_after(timeout):
        while True:
            receipt = await ledger.receipt(run_id)
            if receipt.run_state not in (RunState.RUNNING, RunState.PAUSED):
                return None
            if all(line.status.resolved for line in receipt.lines):
                return receipt
            await ledger.wait_for_change(run_id)


async def _canceller(url: str, deadline: float) -> dict[str, Any]:
    return await _with_ledger(url, deadline, _cancel_some, deadline)


async def _cancel_some(ledger: stopline.Ledger, deadline: float) -> dict[str, Any]:
    rng = random.Random()
    counts = {"cancels": 0, "typed_errors": 0}
    while time.time() < deadline:
        await anyio.sleep(rng.uniform(0.05, 0.3))
        try:
            running = await ledger.backend.list_runs(state=RunState.RUNNING, limit=50)
            if running:
                victim = rng.choice(running)
                await ledger.cancel(victim.id, by=stopline.operator(CANCELLER))
                counts["cancels"] += 1
        except StoplineError:
            counts["typed_errors"] += 1
    return counts
