"""The runtime's shared state: what every component of a ``Ledger`` reads and calls.

A ``Ledger`` is a facade over named components: ``Lifecycle`` (authority,
cancel, pause, resume, approvals), ``Truth`` (recovery, reconciliation,
compensation, review), ``Outcomes`` (recording what calls proved), the
``Settler`` (settling cancelled runs) and the ``Outbox`` (outcomes the ledger
could not take yet). They share one ``Core``, built first and passed to each:
the backend, this process's runs and tools, the task group background work
runs in, and the change events waiters sleep on. The components one another
needs (``outcomes``, ``settler``, ``outbox``, ``compensator``) are set on the
core once, by the facade, before it is opened.

Invariant: a component reaches another only through public names, the
core's or the other's; none reads another object's private attributes
(``tests/architecture/test_private_reach.py``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import sniffio
from anyio.abc import TaskGroup

from stopline.domain.lifecycle import AccessPolicy
from stopline.domain.limits import check_wait
from stopline.errors import InvalidInput, LedgerClosed, WrongEventLoop
from stopline.ledger import redact
from stopline.ledger.backend import Backend
from stopline.runtime.boundary import Boundary, Health
from stopline.runtime.tool import Tool

if TYPE_CHECKING:
    from stopline.runtime.compensate import Compensator
    from stopline.runtime.outbox import Outbox
    from stopline.runtime.outcomes import Outcomes
    from stopline.runtime.run import Run
    from stopline.runtime.settle import Settler, VerifyBudget

__all__ = ["Core"]


class Core:
    """The state a ``Ledger``'s components share (internal: not a stable API)."""

    # the components others call, set once by the facade (they need one another)
    outcomes: Outcomes
    settler: Settler
    outbox: Outbox
    compensator: Compensator

    def __init__(
        self,
        url: str,
        *,
        access: AccessPolicy,
        verify_budget: VerifyBudget,
        durable_outcomes: bool,
        backend: Backend | None,
        tools: Iterable[Tool[Any]],
    ) -> None:
        self.url = url
        # R11: who may cancel, pause, resume, approve and resolve
        self.access = access
        self.verify_budget = verify_budget
        # False (default): the outcome commits with the next group commit, within a few
        # ms, and a crash in between leaves it to reconciliation. True (strict): a call
        # returns once its outcome is durable (ADR 0022, revisiting 0006)
        self.durable_outcomes = durable_outcomes
        # how long the settler waits for a provider's answer to a cancel request before
        # it records "cancel_unanswered" and lets the operation's own outcome decide
        self.cancel_answer_timeout = 30.0
        # this process's identity in the ledger: operations record the worker that
        # passed the gate, so crash recovery can tell a dead worker's from a live one's
        self.worker_id = f"worker_{uuid.uuid4().hex[:16]}"
        # background work runs behind an error boundary; what it saw is `health`
        self.health = Health()
        self._boundary = Boundary(self.health)
        self._backend = backend
        self._tg: TaskGroup | None = None
        self._closing = False
        self._closed = False  # its backend closed (``close``): a ledger opens once
        self._home: int | None = None  # the thread whose event loop opened it (``start``)
        self._home_loop: anyio.lowlevel.EventLoopToken | None = None
        # its backend's connections belong to that loop (PostgreSQL's): used from another
        # thread's loop, a read waited out its answer timeout, or cost this worker its
        # lease; refused there (``backend``, ADR 0086)
        self._loop_bound = False
        # the runs of this process with their block open, by id
        self.runs: dict[str, Run] = {}
        self._opened = itertools.count()  # the order in which their blocks opened
        # known tools by name: verifiable and cancellable from this process
        self.tools: dict[str, Tool[Any]] = {}
        for tool in tools:
            self.register_tool(tool)
        self._adopted: dict[Callable[..., Any], Tool[Any]] = {}
        self._changes: dict[str, anyio.Event] = {}
        # runs a call waits on at the gate while they are paused: how many calls each
        self._paused: dict[str, int] = {}
        self._watching_paused = False  # the one read of them all is under way
        self.paused_poll = 0.25  # seconds between two reads of them
        self.paused_fallback = 5.0  # a call asks the gate itself after this long anyway
        # the ledger's change mark, shared by this process's waiters (``ledger_mark``)
        self._mark = ""
        self._mark_at = -math.inf
        self._mark_lock: anyio.Lock | None = None
        self.mark_max_age = 0.1

    # -- the backend ---------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """The open backend, else ``LedgerClosed`` (not opened yet, or closed: the same
        answer on every engine, where SQLite's was a bare ``RuntimeError`` and
        PostgreSQL's a ``LedgerUnavailable``, a fault a caller waits out). A backend
        bound to its loop (PostgreSQL's), asked for in another thread's running loop,
        is ``WrongEventLoop`` before anything is tried (ADR 0086)."""
        if self._backend is None:
            raise LedgerClosed(redact(self.url), "is not open: use 'async with stopline.open(...)'")
        if self._closed:
            raise LedgerClosed(
                redact(self.url),
                "is closed: a ledger opens once; open it again with stopline.open(url)",
            )
        if self._loop_bound and not self.at_home_now and _in_a_loop():
            raise WrongEventLoop(
                redact(self.url),
                "a PostgreSQL ledger is used in the loop that opened it (its connections "
                "are that loop's): open one in this loop (stopline.open(url), as another "
                "process would), or hand the call to that loop "
                "(asyncio.run_coroutine_threadsafe(coro, loop))",
            )
        return self._backend

    @property
    def opened(self) -> bool:
        """Whether a backend is attached (given, or opened by ``use_backend``)."""
        return self._backend is not None

    def use_backend(self, backend: Backend) -> None:
        self._backend = backend

    async def close(self) -> None:
        """Close the backend; from now on the ledger is closed (``backend``)."""
        backend = self.backend
        self._closed = True
        await backend.close()

    # -- background work -------------------------------------------------------------
    def start(self, tg: TaskGroup) -> None:
        """Background work runs in ``tg`` from now on (the ledger's, while it is open)."""
        self._tg = tg
        self._home, self._home_loop = threading.get_ident(), anyio.lowlevel.current_token()
        self._loop_bound = self.backend.bound_to_its_loop

    def at_home(self, what: str) -> None:
        """``WrongEventLoop`` unless called in the thread whose event loop opened the
        ledger: a run's block and its calls live there (its cancels are delivered there,
        and a cancel scope is not cancelled from another thread). A block entered from
        another thread's loop worked until a cancel: the cancel escaped it as a bare
        ``CancelledError`` and left its run settling (ADR 0078)."""
        if not self.at_home_now:
            how = "open one in each loop, or hand the work to its loop (anyio.from_thread.run)"
            raise WrongEventLoop(redact(self.url), f"{what} there: {how}")

    @property
    def at_home_now(self) -> bool:
        """Whether this is the thread whose event loop opened the ledger (or it is not
        open): where this process's runs are interrupted."""
        return self._home is None or threading.get_ident() == self._home

    def at_home_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """``fn(*args)`` called soon in the event loop that opened the ledger, from another
        thread's, without waiting for it (that loop may be waiting for this thread: a
        test's ``TestClient`` call blocks it), sniffio told the loop's library."""
        assert self._home_loop is not None
        native: Any = self._home_loop.native_token  # asyncio's loop, or trio's token
        library = "asyncio" if hasattr(native, "call_soon_threadsafe") else "trio"
        soon = getattr(native, "call_soon_threadsafe", None) or native.run_sync_soon
        soon(functools.partial(_told, library, fn, *args))

    def stop(self) -> TaskGroup | None:
        """No new background work; returns the task group to close."""
        tg, self._tg, self._closing = self._tg, None, True
        return tg

    @property
    def running(self) -> bool:
        """Whether background work can start now (the ledger is open, not closing)."""
        return self._tg is not None

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Start background work that outlives the caller's scope."""
        if self._tg is None:
            if self._closing:
                return  # closing: background work stops with the ledger
            raise LedgerClosed(redact(self.url), "is not open: use 'async with stopline.open(...)'")
        self._tg.start_soon(self._boundary.run, fn, *args)

    def register_run(self, run: Run) -> None:
        """A run's block opens: it joins ``runs``, numbered in the order blocks open
        (``Run.opened``, what a delivery reads nesting from, whatever else is open)."""
        run.opened = next(self._opened)
        self.runs[run.id] = run

    # -- tools -----------------------------------------------------------------------
    def register_tool(self, tool: Tool[Any]) -> None:
        """``tool`` known by its name from now on: the ledger records a call's tool by
        name, and reads back, cancels and corrects its operations with the tool known
        by that name. The same tool again, or one declaring the same (``declares_as``),
        is fine; another under a known name is ``InvalidInput``: its operations would
        have been read back and corrected by the first one's functions (ADR 0078)."""
        known = self.tools.setdefault(tool.name, tool)
        if known is not tool and not known.declares_as(tool):
            raise InvalidInput(
                "tool",
                f"{tool.name!r} names another tool in this ledger already, declared "
                "otherwise (its verifier, canceller, compensator, policy or horizon): a "
                "name is one tool, by which its operations are read back, cancelled and "
                "corrected; give this one its own name (stopline.tool(name=...)) or use "
                "the one declared",
            )

    def adopt(self, fn: Callable[..., Awaitable[Any]]) -> Tool[Any]:
        try:
            tool = self._adopted.get(fn)
        except TypeError:  # unhashable: made a tool each time (refused there if unusable)
            return Tool(fn)
        if tool is None:
            tool = self._adopted[fn] = Tool(fn)
        return tool

    # -- changes -----------------------------------------------------------------------
    def changed(self, run_id: str) -> None:
        """Wake whoever waits for a change of the run in this process."""
        event = self._changes.pop(run_id, None)
        if event is not None:
            event.set()

    async def wait_for_change(self, run_id: str, *, poll: float = 0.25) -> bool:
        """Until this process changes the run, or ``poll`` s for other processes' changes.
        True if this process changed it."""
        event = self._change_event(run_id)
        with anyio.move_on_after(check_wait("poll", poll)):
            await event.wait()
        self._forget_unwaited(run_id, event)
        return event.is_set()

    async def ledger_mark(self) -> str:
        """``Backend.change_mark``, read at most once each ``mark_max_age`` s for every
        caller in this process (a caller compares it with the mark it read before its
        last read of the ledger: equal, nothing was committed since)."""
        if time.monotonic() - self._mark_at >= self.mark_max_age:
            if self._mark_lock is None:
                self._mark_lock = anyio.Lock()
            async with self._mark_lock:  # one read for the callers asking meanwhile
                if time.monotonic() - self._mark_at >= self.mark_max_age:
                    read_at = time.monotonic()
                    self._mark = await self.backend.change_mark()
                    self._mark_at = read_at
        return self._mark

    async def wait_while_paused(self, run_id: str) -> None:
        """For a call its run's pause stopped at the gate: until the run may have moved
        on. This process changed it (a resume, a cancel), or the process's one read of
        every run waited on here, each ``paused_poll`` s, found it no longer paused
        (another process's resume or cancel). Each waiting call asked the gate again
        every 0.25 s before: 1,000 of them were 4,000 gate transactions a second.
        Should that read fail (it is retried behind the boundary), a call asks the
        gate again after ``paused_fallback`` s at the latest."""
        event = self._change_event(run_id)
        self._paused[run_id] = self._paused.get(run_id, 0) + 1
        if not self._watching_paused and self.running:
            self._watching_paused = True
            self.spawn(self._watch_paused)
        try:
            with anyio.move_on_after(self.paused_fallback):
                await event.wait()
        finally:
            left = self._paused.pop(run_id) - 1
            if left:
                self._paused[run_id] = left
            self._forget_unwaited(run_id, event)

    async def _watch_paused(self) -> None:
        """The one read of the paused runs calls wait on, each ``paused_poll`` s, while
        any do. (A retry after a failed read may overlap a watch a later call started:
        both only read, and both end once no call waits.)"""
        self._watching_paused = True
        try:
            while self._paused:
                await anyio.sleep(self.paused_poll)
                waited = list(self._paused)
                found = await self.backend.get_runs(waited) if waited else {}
                for run_id in waited:
                    run = found.get(run_id)
                    if run is None or not run.state.paused:
                        self.changed(run_id)
        finally:
            self._watching_paused = False

    def _change_event(self, run_id: str) -> anyio.Event:
        event = self._changes.get(run_id)
        if event is None:
            event = self._changes[run_id] = anyio.Event()
        return event

    def _forget_unwaited(self, run_id: str, event: anyio.Event) -> None:
        if not event.statistics().tasks_waiting and self._changes.get(run_id) is event:
            del self._changes[run_id]  # per-run state ends when nobody waits on it

    @property
    def waiting_runs(self) -> int:
        """Runs someone in this process waits on a change of (bounded: see above)."""
        return len(self._changes)


def _told(library: str, fn: Callable[..., object], *args: Any) -> None:
    token = sniffio.current_async_library_cvar.set(library)
    try:
        fn(*args)
    finally:
        sniffio.current_async_library_cvar.reset(token)


def _in_a_loop() -> bool:
    """Whether this thread runs an event loop (asyncio's: PostgreSQL's is asyncio only)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
