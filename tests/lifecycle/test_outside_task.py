"""A cancel's cut runs outside any task on asyncio (``outside_task``).

anyio's ``CancelScope.cancel`` formats the repr of the task it runs in (~70 µs here,
most of a delivered cancel's own time); a plain callback of the loop has none. The
caller waits for it shielded, and gets its result or its error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import pytest
import uvloop

import stopline
from stopline.domain.vocab import Cause, OpStatus
from stopline.ledger import open_backend
from stopline.ledger.backend import RunSpec
from stopline.runtime.lifecycle import Lifecycle, outside_task
from stopline.runtime.outcomes import INTERRUPTED
from stopline.testing import FakeProvider
from tests.postgres.server import fresh_schema
from tests.support.held import Held
from tests.support.scopes import scope_cancels

pytestmark = pytest.mark.uvloop_too  # a loop we did not write (conftest)


async def test_it_runs_in_no_task_and_hands_back_its_result() -> None:
    seen: list[asyncio.Task[object] | None] = []

    def fn() -> int:
        seen.append(asyncio.current_task())
        return 7

    assert await outside_task(fn) == 7
    assert seen == [None]


async def test_its_error_is_raised_to_the_caller() -> None:
    def fn() -> None:
        raise LookupError("from the callback")

    with pytest.raises(LookupError, match="from the callback"):
        await outside_task(fn)


async def test_a_cancelled_caller_still_gets_it_done() -> None:
    """Shielded: a cut once asked for always happens and is handed back (the rest of
    the delivery follows it), even when the caller's own scope is cancelled."""
    ran: list[int] = []

    def fn() -> int:
        ran.append(1)
        return len(ran)

    with anyio.CancelScope() as scope:
        scope.cancel()
        got = await outside_task(fn)
        assert got == 1
    assert ran == [1]


async def test_a_cancel_cuts_its_run_outside_the_cancellers_task(tmp_path: Path) -> None:
    """The run's scope is cancelled from no task: nothing of the canceller is formatted."""
    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}?cancel_poll_ms=0") as ledger:
        held = Held(ledger)
        with scope_cancels() as by:
            await held.cancelled()
    assert by and by[0] is None


async def test_a_notified_cancel_is_cut_outside_the_watchs_task(tmp_path: Path) -> None:
    """A cancel committed by another backend on the file, delivered by the watch."""
    url = f"sqlite:///{tmp_path / 'l.db'}"
    async with stopline.open(url) as ledger:
        held = Held(ledger)
        other = await open_backend(url)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(held.workflow)
                await held.entered.wait()
                with scope_cancels() as by:
                    await other.cancel(held.ids[0], by="u")
                    await held.interrupted.wait()
        finally:
            await other.close()
    assert by and by[0] is None


async def test_an_error_delivering_a_notified_cancel_is_logged_and_the_ledger_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delivery that raises is the loop's to report; the watch and the ledger's other
    work go on (it used to end the ledger's task group)."""
    url = f"sqlite:///{tmp_path / 'l.db'}"
    reported: list[BaseException | None] = []
    told = anyio.Event()

    def report(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        error = context.get("exception")
        reported.append(error if isinstance(error, BaseException) else None)
        told.set()

    def broken(self: Lifecycle, run_ids: object) -> set[str]:
        raise RuntimeError("delivery broke")

    loop = asyncio.get_running_loop()
    loop.set_exception_handler(report)
    try:
        async with stopline.open(url) as ledger:
            other = await open_backend(url)
            try:
                await other.create_run(RunSpec("elsewhere", "r", "u", "t"))
                with monkeypatch.context() as patched:
                    patched.setattr(Lifecycle, "deliver_cancel", broken)
                    await other.cancel("elsewhere", by="u")
                    await told.wait()
                # then a cancel the watch delivers whole, and a run of this process
                held = Held(ledger)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(held.workflow)
                    await held.entered.wait()
                    await other.cancel(held.ids[0], by="u")
                    await held.interrupted.wait()
            finally:
                await other.close()
            async with ledger.run("after", owner="u") as run:
                assert await run.call(FakeProvider("send").tool, 1) is not None
    finally:
        loop.set_exception_handler(None)
    assert [str(e) for e in reported] == ["delivery broke"]


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio.run", "uvloop.run"])
@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
def test_a_notified_cancel_under_plain_asyncio_records_what_it_interrupted(
    tmp_path: Path, engine: str, run: Callable[[Coroutine[Any, Any, Any]], Any]
) -> None:
    """An application's own ``asyncio.run`` (or ``uvloop.run``, many servers' loop): no
    anyio runner has told sniffio which loop this is, so anyio cannot start a task from
    a plain callback of the loop. The watch's delivery runs in one (outside the watch's
    task); the rest of it (the interrupted call's record, its provider asked) starts
    tasks all the same."""

    async def scenario(url: str) -> stopline.Receipt:
        async with stopline.open(url) as ledger:
            held = Held(ledger)
            other = await open_backend(url)
            try:
                async with held.in_flight():
                    await other.cancel(held.ids[0], by="u")
                return await ledger.wait_settled(held.ids[0], timeout=10)
            finally:
                await other.close()

    with contextlib.ExitStack() as stack:
        if engine == "sqlite":
            url = f"sqlite:///{tmp_path / 'l.db'}"
        else:
            url = stack.enter_context(contextlib.contextmanager(fresh_schema)())
        # a thread of its own starts with an empty context, as an application's does
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            receipt = pool.submit(run, scenario(url)).result(timeout=60)
    (line,) = receipt.lines
    assert line.status is OpStatus.NEEDS_REVIEW  # unknown (R3), and no read-back
    assert (Cause.USER_CANCEL.value, INTERRUPTED) in [(e.ref, e.detail) for e in line.evidence]
