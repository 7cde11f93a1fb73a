"""Cancels committed by other processes, delivered through LISTEN/NOTIFY.

A cancel's transaction notifies the fenced run ids (``engine.fence``, through the dialect);
the server sends them at commit. One dedicated connection per backend
listens and hands each batch to the runtime, which interrupts the in-flight
calls of those runs in this process.

The notification only speeds up interruption: the gate reads the fence, so a
notification lost while this connection is down never lets a dispatch
through (R1). When the connection drops, it is re-established with backoff
and the cancels committed since it was last known to listen are caught up from
``runs.cancelled_at`` (through its index, schema V6), with ``CATCH_UP_SLACK`` seconds
of slack for clock skew between hosts. A connection that stops answering without
closing (its server frozen, its packets dropped: no TCP keepalive notices a socket the
peer's kernel still answers) is noticed by asking it: after ``answer_wait`` without a
notification it runs a statement, answered within ``answer_wait`` or the connection
is dropped as lost (ADR 0064). Each statement of this connection is so bounded, and
the session left behind is asked to end once a new one listens (a session that never
reads holds the server's notification queue from being truncated). Delivering a run twice
is harmless: the runtime skips runs it already knows are cancelled. Only runs
still fenced when a notification is read are delivered: a run resumed since
its cancel is not cancelled again here. That read goes over the LISTEN
connection itself, between two waits for notifications (psycopg keeps what
arrives meanwhile for the next wait), not through the pool: no checkout, and
no waiting behind a pool the process's own calls keep busy. A run with a call
in flight here, its tool not yet answered (the runtime's ``holding``), needs
no read: a resume needs every operation of the run resolved (R10), and that
call's is resolved by this process once its tool answers, or by recovery once
this process was taken for dead (ADR 0041). A notification naming only such
runs, the common case of a cancel that interrupts work, is delivered at once.
So the channel is the ledger's secret (schema V5, ``notify_channel``): a role
that cannot read the ledger cannot send what is acted on unread, and the
``LISTEN`` statement takes the name from the table rather than showing it.

A cancel's notification also comes back to the backend that committed it,
whose caller has the fenced runs already (the runtime delivers them itself).
``OwnCancels`` keeps, for a few seconds, each run this backend's ``cancel``
returned as fenced with the server process that committed it; a notification
from that process naming such a run is neither read nor handed on, once. A
cancel whose reply was lost returns nothing, so nothing is kept for it: its
notification is then how it reaches this process's calls.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import psycopg
import psycopg.errors

from stopline.errors import LedgerError
from stopline.ledger.engine import reads
from stopline.ledger.engine.guards import FENCED
from stopline.ledger.postgres_errors import answered_within
from stopline.ledger.postgres_settle import Sessions
from stopline.ledger.postgres_txn import Tx

if TYPE_CHECKING:
    from stopline.ledger.postgres import PostgresBackend

__all__ = ["CATCH_UP", "CATCH_UP_SLACK", "Listener", "OwnCancels"]

CATCH_UP_SLACK = 60.0
_FENCED = frozenset(state.value for state in FENCED)
# The runs cancelled since a time, through their index (schema V6). A ledger not yet
# analyzed is planned with PostgreSQL's guesses: a third of the table for an open range
# (it scanned the table), half a percent for a closed one, hence the upper bound that
# excludes nothing. Those still fenced are kept here, not in the statement: with the
# state in it, the state index's entries of every run ever fenced were read as well.
CATCH_UP = "SELECT id, state FROM runs WHERE cancelled_at BETWEEN %s AND 'infinity'"
# LISTEN on the ledger's channel, named by the server from the ledger itself: the
# statement's text (pg_stat_activity, pg_stat_statements) never shows the name
_LISTEN = "DO $$BEGIN EXECUTE format('LISTEN %I', (SELECT name FROM notify_channel)); END$$"
log = logging.getLogger("stopline.ledger.postgres")


class OwnCancels:
    """The runs this backend's own cancels fenced, by the server process that committed
    them, for ``hold`` seconds (a notification comes back within milliseconds)."""

    LIMIT = 65_536  # runs kept at most (a tree's); the oldest go first

    WAIT = 0.25  # how long a notification waits for the own cancels under way, at most

    def __init__(self, hold: float = 5.0) -> None:
        self.hold = hold
        self._kept: dict[tuple[str, int], float] = {}  # (run, server pid) -> until
        self._under_way: set[anyio.Event] = set()  # one per own cancel not yet returned

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """An own cancel under way: it keeps its runs (``add``) before it ends."""
        done = anyio.Event()
        self._under_way.add(done)
        try:
            yield
        finally:
            self._under_way.discard(done)
            done.set()

    async def sent(self) -> None:
        """Until the own cancels under way now have returned, their runs kept (at most
        ``WAIT``: a notification is never held longer behind a cancel that hangs). A
        notification and its own cancel's reply arrive together; without this the
        listener could read the notification first."""
        pending = list(self._under_way)
        if not pending:
            return
        with anyio.move_on_after(self.WAIT):
            for done in pending:
                await done.wait()

    def add(self, run_ids: Sequence[str], pid: int) -> None:
        now = time.monotonic()
        kept = self._kept
        # kept in the order they expire (each added at now + hold): the expired first
        while kept and next(iter(kept.values())) <= now:
            del kept[next(iter(kept))]
        for run_id in run_ids:
            kept.pop((run_id, pid), None)
            kept[(run_id, pid)] = now + self.hold
        while len(kept) > self.LIMIT:
            del kept[next(iter(kept))]

    def others(self, run_ids: Sequence[str], pid: int) -> list[str]:
        """The runs of a notification from server process ``pid`` that are not this
        backend's own (each of its own taken once: a later cancel of it is not)."""
        kept = self._kept
        if not kept:
            return list(run_ids)
        now = time.monotonic()
        out = []
        for run_id in run_ids:
            until = kept.pop((run_id, pid), None)
            if until is None or until <= now:
                out.append(run_id)
        return out


class Listener:
    """The LISTEN connection of one backend, kept alive."""

    def __init__(self, backend: PostgresBackend) -> None:
        self._backend = backend
        self.connections = 0  # how many times LISTEN was established
        self.connected = anyio.Event()  # set while listening (replaced after a drop)
        self.pid: int | None = None  # the server process of the LISTEN connection
        # why it stopped for good: the ledger's tables gone under it (nothing to listen
        # for: every call and step of this ledger meets the same error), else None
        self.stopped: BaseException | None = None
        self.ended = anyio.Event()  # set once it stopped for good
        # testing hook: awaited after a drop, before reconnecting
        self.before_reconnect: Callable[[], Awaitable[None]] | None = None
        self.left = Sessions()  # the sessions it dropped: ended once a new one listens

    async def run(
        self,
        on_cancel: Callable[[list[str]], None],
        *,
        holding: Callable[[str], bool] | None = None,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        backend = self._backend
        if backend.read_only:  # a reader runs no calls, and does not know the channel
            task_status.started()
            return
        listening: float | None = None  # when it was last known to listen (wall clock,
        # as the ledger's times are): every cancel committed before then was heard
        delay = 0.01
        started = False
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    backend.conninfo, application_name="stopline-listen", **backend.connect_kwargs
                )
            except (psycopg.Error, OSError) as exc:
                if not started:
                    raise backend.map_error(exc) from exc
                log.warning("cancel listener: reconnect failed (%s); retrying", exc)
                await anyio.sleep(delay)  # back off before the next attempt
                delay = min(delay * 2, 1.0)
                continue
            tx = Tx(conn, backend.location, backend.dialect)
            try:
                async with conn:
                    asked = time.time()
                    with answered_within(backend.answer_wait):
                        await conn.execute(_LISTEN)
                        if self.left:
                            await self.left.gone(tx)  # the sessions dropped before: ended
                        if listening is not None:
                            await self._catch_up(conn, listening - CATCH_UP_SLACK, on_cancel)
                    listening = asked
                    self.pid = conn.info.backend_pid
                    self.connections += 1
                    self.connected.set()
                    if not started:
                        task_status.started()
                        started = True
                    delay = 0.01

                    async def fenced(run_ids: Sequence[str], tx: Tx = tx) -> list[str]:
                        with answered_within(backend.answer_wait):
                            return await reads.fenced_among(tx, run_ids)

                    while True:
                        # leave the wait after each packet of notifications, so the
                        # check can use this connection; what arrives meanwhile waits
                        notes = [
                            note
                            async for note in conn.notifies(
                                timeout=backend.answer_wait, stop_after=1
                            )
                        ]
                        if not notes:  # silence: is the connection still answering?
                            asked = time.time()
                            with answered_within(backend.answer_wait):
                                await conn.execute("SELECT 1")
                            listening = asked  # every notification sent before, read
                        for note in notes:
                            await self.deliver(
                                note.payload, on_cancel, fenced, pid=note.pid, holding=holding
                            )
            except (psycopg.Error, OSError) as exc:
                if not started:
                    raise backend.map_error(exc) from exc
                if isinstance(exc, psycopg.errors.UndefinedTable):
                    self.stopped = backend.map_error(exc)
                    log.error("cancel listener: stopped (%s)", self.stopped)
                    self.ended.set()
                    return
                log.warning("cancel listener: connection lost (%s); re-listening", exc)
                self.left.lost(tx)  # if it is still there, ended from the next one
            finally:
                # A cancelled listener's ``async with`` exit is itself cancelled at
                # its rollback (anyio re-delivers the cancel at every await), which
                # skips psycopg's close: close here, shielded, so no connection leaks.
                with anyio.move_on_after(5, shield=True):
                    await conn.close()
            self.connected = anyio.Event()
            if self.before_reconnect is not None:
                await self.before_reconnect()

    async def deliver(
        self,
        payload: str,
        on_cancel: Callable[[list[str]], None],
        fenced: Callable[[Sequence[str]], Awaitable[list[str]]] | None = None,
        *,
        pid: int | None = None,
        holding: Callable[[str], bool] | None = None,
    ) -> None:
        """One notification to the runtime, only for the runs still fenced (``fenced``:
        the check, by default through the pool): one resumed since its cancel (a
        notification read late) must not be cancelled again. The runs ``holding``
        names (a call of theirs in flight here, its tool not yet answered: not
        resumed since, ADR 0041) are not checked; a notification naming only those
        is delivered without a read. ``pid``: the server process that sent it; the
        runs this backend's own cancel fenced there are left out, unread
        (``OwnCancels``). A malformed one is logged, never fatal; if the check cannot
        be read, all are delivered (a cancel only speeds up; the gate reads the
        fence), and a connection lost under it is then noticed by the next wait."""
        try:
            run_ids = [str(r) for r in json.loads(payload)]
        except (ValueError, TypeError):
            log.warning("cancel listener: ignoring a malformed notification %r", payload[:200])
            return
        if pid is not None:
            own = self._backend.own_cancels
            # an own cancel whose reply came in with this notification keeps its runs
            # before they are looked for (no wait while none is under way)
            await own.sent()
            run_ids = own.others(run_ids, pid)
            if not run_ids:
                return
        held = set() if holding is None else {r for r in run_ids if holding(r)}
        unsure = [r for r in run_ids if r not in held]
        if unsure:
            try:
                still = set(await (fenced or self._backend.fenced_among)(unsure))
            except (LedgerError, psycopg.Error, OSError) as exc:
                log.warning("cancel listener: could not check %s (%s); delivering", unsure, exc)
                still = set(unsure)
            # one delivery, in the notification's order (a tree's runs cut together)
            run_ids = [r for r in run_ids if r in held or r in still]
        if run_ids:
            on_cancel(run_ids)

    async def _catch_up(
        self,
        conn: psycopg.AsyncConnection[Any],
        since: float,
        on_cancel: Callable[[list[str]], None],
    ) -> None:
        cur = await conn.execute(CATCH_UP, (since,))
        missed = [str(run_id) for run_id, state in await cur.fetchall() if state in _FENCED]
        if missed:
            on_cancel(missed)
