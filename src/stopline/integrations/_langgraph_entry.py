"""Entering a LangGraph thread's current run when other workers may enter it too
(ADR 0112).

``sl.run`` on a thread reads its runs (``runs_of``), then enters the current one. Two
entries of one thread at once (a message delivered twice, two browser tabs, two
workers of one queue) met the ledger's own answers, none of which is right for a
thread:

- the run read as current *ended* before the entry (the other worker's turn was
  over): ``RunEnded`` with the guidance for an ended run, "start a new run (its
  actions get new keys)", where entering the thread again finds its next run. Such an
  entry now reads the thread's runs again and enters the next one (``entered``);
- both read that the next run does not exist yet and both made it: the second insert
  of one id was a raw duplicate-key error (``LedgerRefused`` on SQLite, "would refuse
  it again"; a bare ``LedgerError`` on PostgreSQL), or, in one process,
  ``AlreadyAttached`` ("use the Run object it gave"). Now the run is made in one
  insert of its own (``claim``), before the entry: the entry whose insert another's
  beat, and one whose run another task of this process holds, raises ``LedgerLocked``
  (``busy``) naming the thread and the run and saying to retry once that turn has
  ended; it wrote and ran nothing.

Why not let both in: the first block to end ends the run ``completed`` under the
other, whose later calls are then stopped at the dispatch gate and whose block ends
quietly (a turn cut with nothing said), and in one process a run has one block at a
time. LangGraph's checkpoints do not take two invocations of one thread at once
either (LangGraph Platform refuses the second by default: "reject").
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TypeVar

from stopline.errors import (
    AlreadyAttached,
    CommitInDoubt,
    LedgerError,
    LedgerLocked,
    LedgerUnavailable,
    RunEnded,
    UnknownRun,
)
from stopline.integrations._langgraph_thread import OVER, Thread, runs_of
from stopline.ledger.backend import RunSpec
from stopline.runtime.ledger import Ledger
from stopline.runtime.scope import check_new_run

__all__ = ["busy", "claim", "entered"]

T = TypeVar("T")

_ENTRIES = 8  # reads of the thread's runs by one entry whose run keeps ending under it


async def entered(
    stack: contextlib.AsyncExitStack,
    ledger: Ledger,
    thread_id: str,
    spec: RunSpec,
    opening: Callable[[Thread], contextlib.AbstractAsyncContextManager[T]],
) -> T:
    """The thread's current run, entered on ``stack`` by ``opening(thread)``: made first
    when it does not exist (``claim``), read again when it ended between the read and
    the entry. ``spec``: what a run of the thread is made with (its id: the thread's
    first run's). ``LedgerLocked`` (``busy``) when another entry is in it now."""
    for _ in range(_ENTRIES):
        thread = await runs_of(ledger, spec.id, spec.tenant)
        if thread.new:
            await claim(ledger, thread_id, dataclasses.replace(spec, id=thread.run_id))
        try:
            return await stack.enter_async_context(opening(thread))
        except RunEnded as ended:  # another worker's turn ended since the read: the next
            if ended.run_id != thread.run_id or ended.state not in OVER:
                raise
        except AlreadyAttached as held:
            raise busy(ledger, thread_id, thread.run_id, "this process is in it") from held
    raise busy(ledger, thread_id, thread.run_id, f"it ended {_ENTRIES} times under this entry")


async def claim(ledger: Ledger, thread_id: str, spec: RunSpec) -> None:
    """Make the thread's next run in one insert, as ``ledger.run`` would (its ids
    checked as ids being made). An insert another entry's beat at the same moment is
    ``busy``: nothing was written."""
    check_new_run(spec)
    try:
        await ledger.backend.create_run(spec)
    except LedgerError as exc:
        if isinstance(exc, LedgerUnavailable | CommitInDoubt) or not await _made(ledger, spec.id):
            raise  # not another entry's run: the ledger's own error
        raise busy(ledger, thread_id, spec.id, "another worker made it at the same moment") from exc


async def _made(ledger: Ledger, run_id: str) -> bool:
    try:
        await ledger.backend.get_run(run_id)
    except UnknownRun:
        return False
    return True


def busy(ledger: Ledger, thread_id: str, run_id: str, why: str) -> LedgerLocked:
    """Another entry of the thread is in its run ``run_id`` now: retry once it ended."""
    return LedgerLocked(
        ledger.backend.location,
        f"thread {thread_id!r} is being entered by another worker at the same moment: its "
        f"run {run_id!r} is taken ({why}), and LangGraph runs one invocation of a thread "
        "at a time. This entry wrote and ran nothing: retry once that turn has ended "
        "(sl.run on the thread then enters its next run)",
    )
