"""Issue 20 on one SQLite file: a cancel committed by another process (the CLI, from a
shell) reaches this process's calls in flight, not only its next gate."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

import stopline
from stopline import CancelState, Headline, OpStatus
from stopline.ledger.sqlite import SQLiteBackend
from stopline.ledger.sqlite_watch import CancelWatch
from stopline.testing import FakeProvider

pytestmark = pytest.mark.uvloop_too  # a loop we did not write (conftest)


async def cli(*args: str) -> tuple[int, dict[str, object]]:
    env = {k: v for k, v in os.environ.items() if k != "STOPLINE_LEDGER"}
    command = [sys.executable, "-m", "stopline.cli", *args]
    done = await anyio.run_process(command, env=env, check=False)
    return done.returncode, json.loads(done.stdout)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_cancel_from_another_process_asks_the_call_in_flight_to_stop(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    asked, stopped = anyio.Event(), anyio.Event()
    entered = anyio.Event()

    @stopline.tool
    async def upload(ctx: stopline.CallContext, name: str) -> str:
        entered.set()
        await stopped.wait()  # the provider works until asked to stop
        raise stopline.Rejected("upload stopped before it stored anything", ref="upload:stopped")

    @upload.canceller
    async def stop_upload(ctx: stopline.CallContext) -> bool:
        asked.set()
        stopped.set()
        return True  # the provider confirms: nothing was stored

    async with stopline.open(url) as ledger, anyio.create_task_group() as tg:
        run_ids: list[str] = []

        async def workflow() -> None:
            async with ledger.run("upload", owner="user:1") as run:
                run_ids.append(run.id)
                await run.call(upload, "report.pdf")

        tg.start_soon(workflow)
        await entered.wait()
        # another process, knowing nothing of this one, commits the cancel
        code, at_cancel = await cli(
            "--ledger", url, "cancel", run_ids[0], "--by", "user:1", "--json"
        )
        assert (code, at_cancel["headline"]) == (3, "awaiting_confirmation")  # 3: not settled
        with anyio.fail_after(20):  # a hang guard only: without the watch this never comes
            await asked.wait()
        receipt = await ledger.wait_settled(run_ids[0], timeout=30)
    op = (await _operations(url, run_ids[0]))[0]
    assert op.cancel_state is CancelState.CONFIRMED
    assert op.status is OpStatus.NOT_COMMITTED
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION


async def _operations(url: str, run_id: str) -> list[stopline.OperationRecord]:
    async with stopline.open(url) as ledger:
        return list(await ledger.backend.operations(run_id))


class Delivered:
    """What ``ledger.on_cancel`` handed over, with an event for the first delivery."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.arrived = anyio.Event()

    def __call__(self, run_ids: Sequence[str]) -> None:
        self.batches.append(list(run_ids))
        self.arrived.set()


async def test_a_cancel_committed_by_another_connection_is_delivered(tmp_path: Path) -> None:
    """A cancel committed through another connection to the file (another ledger, as
    another process would) is handed to this ledger's cancel listeners."""
    path = tmp_path / "ledger.db"
    async with stopline.open(f"sqlite:///{path}") as ledger:
        delivered = Delivered()
        remove = ledger.on_cancel(delivered)
        async with stopline.open(f"sqlite:///{path}") as other:
            async with other.run("job", owner="user:1", run_id="r-1"):
                await other.cancel("r-1", by="user:1")  # the block ends here, fenced
            with anyio.fail_after(20):  # hang guard
                await delivered.arrived.wait()
        remove()
    assert delivered.batches == [["r-1"]]


async def test_a_look_reads_the_cancels_since_the_last_not_every_event(tmp_path: Path) -> None:
    """The watch reads the cancel events through their own index (schema V4): a look
    after a thousand calls and one cancel steps over that one cancel, not the ~2,000
    events logged since the last look (counted as SQLite's rows stepped, not timed)."""
    path = tmp_path / "ledger.db"
    provider = FakeProvider("send")
    async with stopline.open(f"sqlite:///{path}?cancel_poll_ms=0") as ledger:
        backend = ledger.backend
        assert isinstance(backend, SQLiteBackend)
        async with ledger.run("job", owner="user:1", run_id="r-busy") as run:
            for i in range(1000):
                await run.call(provider.tool, i)
        watch = CancelWatch(path, busy_timeout=5.0)
        await watch.on_thread(watch.baseline)
        async with ledger.run("job", owner="user:1", run_id="r-more") as run:
            for i in range(1000):
                await run.call(provider.tool, i)
            await ledger.cancel("r-more", by="user:1")
        conn = watch.connection
        assert conn is not None
        traced: list[str] = []
        steps: list[int] = []
        conn.set_trace_callback(traced.append)

        def step() -> int:
            steps.append(1)
            return 0  # go on

        conn.set_progress_handler(step, 1)  # called at every VM instruction
        run_ids = await watch.on_thread(watch.poll)
        conn.set_progress_handler(None, 1)
        conn.set_trace_callback(None)
        (look,) = [sql for sql in traced if "FROM events" in sql]
        plan = [step for *_, step in conn.execute(f"EXPLAIN QUERY PLAN {look}")]
        await watch.on_thread(watch.drop)
    assert run_ids == ["r-more"]
    assert any("events_cancels" in step for step in plan), plan
    assert not any(step.startswith("SCAN e") for step in plan), plan
    # a walk of the log since the baseline steps ~2,000 rows of ~10 instructions each
    assert len(steps) < 1000, len(steps)


async def test_a_broken_watch_connection_is_replaced_and_no_cancel_is_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The watch's connection closed under it: the poll's error is logged, the
    connection replaced, and the cancel committed meanwhile is still delivered."""
    path = tmp_path / "ledger.db"
    async with stopline.open(f"sqlite:///{path}") as ledger:
        backend = ledger.backend
        assert isinstance(backend, SQLiteBackend)
        delivered = Delivered()
        remove = ledger.on_cancel(delivered)
        watch = backend.watch
        assert watch is not None
        conn = watch.connection
        assert conn is not None
        # the next poll meets a closed connection (closed on the watch's own thread slot)
        await watch.on_thread(conn.close)
        async with stopline.open(f"sqlite:///{path}") as other:
            async with other.run("job", owner="user:1", run_id="r-2"):
                await other.cancel("r-2", by="user:1")
            with anyio.fail_after(20):  # hang guard
                await delivered.arrived.wait()
        remove()
    assert delivered.batches == [["r-2"]]
    assert any("cancel watch" in r.getMessage() for r in caplog.records)


async def test_a_cancel_seen_after_its_run_was_resumed_is_not_delivered(tmp_path: Path) -> None:
    """A look that comes after the run was resumed finds its cancel stale: the resumed
    run is not fenced again. The run cancelled and left alone is delivered."""
    path = tmp_path / "ledger.db"
    async with stopline.open(f"sqlite:///{path}") as ledger:
        backend = ledger.backend
        assert isinstance(backend, SQLiteBackend)
        watch = CancelWatch(path, busy_timeout=5.0)  # driven by hand: one look, when we say
        await watch.on_thread(watch.baseline)
        for run_id in ("resumed", "left"):
            async with ledger.run("job", owner="user:1", run_id=run_id):
                await ledger.cancel(run_id, by="user:1")
            await ledger.wait_settled(run_id, timeout=10)
        await ledger.resume("resumed", by="user:1")
        try:
            seen = await watch.on_thread(watch.poll)
        finally:
            await watch.on_thread(watch.drop)
    assert seen == ["left"]


async def test_an_unwatched_ledger_meets_another_process_cancel_at_its_gate(
    tmp_path: Path,
) -> None:
    """``cancel_poll_ms=0`` turns the watch off: a cancel committed elsewhere reaches
    this process at its next gate, which refuses the call (R1 holds without the watch)."""
    path = tmp_path / "ledger.db"
    sent: list[str] = []

    @stopline.tool
    async def upload(name: str) -> str:
        sent.append(name)
        return name

    async with stopline.open(f"sqlite:///{path}?cancel_poll_ms=0") as ledger:
        backend = ledger.backend
        assert isinstance(backend, SQLiteBackend) and backend.watch is None
        async with ledger.run("upload", owner="user:1", run_id="r-3") as run:
            async with stopline.open(f"sqlite:///{path}") as other:
                await other.cancel("r-3", by="user:1")
            with pytest.raises(stopline.RunCancelled):
                await run.call(upload, "report.pdf")
        receipt = await ledger.wait_settled("r-3", timeout=10)
    assert sent == []
    assert [line.status for line in receipt.lines] == [OpStatus.PREVENTED]


@pytest.mark.parametrize("value", ["-1", "soon", "60001"])
async def test_a_bad_cancel_poll_is_refused_by_name(tmp_path: Path, value: str) -> None:
    path = tmp_path / "ledger.db"
    with pytest.raises(stopline.LedgerUnavailable, match=f"cancel_poll_ms={value!r}"):
        async with stopline.open(f"sqlite:///{path}?cancel_poll_ms={value}"):
            pass
    assert not path.exists()  # refused before anything was created
