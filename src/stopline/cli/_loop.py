"""A command's event loop, in a thread of its own, and the Ctrl-Cs that stop it.

``drive(fn)`` runs one coroutine on a fresh asyncio loop in a daemon thread while the
main thread waits for it and takes SIGINT with a handler of its own (``CtrlC``): the
first Ctrl-C cancels the coroutine's cancel scope and the command ends once it has
unwound (its ledger closed); a second ends it at once. A command a Ctrl-C ended
ignores SIGINT from then on, while it reports and the process ends (ADR 0109).
``cli._common.run_sync`` says what the command knows when it was stopped.

Before any of that, ``starting`` takes SIGINT while the command's modules import
(``stopline.cli.main``): a press there is counted, and the command ends before it
starts, having done nothing (ADR 0115).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio

__all__ = ["CtrlC", "Starting", "drive", "starting"]

T = TypeVar("T")


def _soon(loop: asyncio.AbstractEventLoop, call: Callable[[], object]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: nothing left to stop
        loop.call_soon_threadsafe(call)


class Starting:
    """SIGINT's handler while the command's modules import: each press is counted, none
    raised. A ``KeyboardInterrupt`` raised in an import ended the command with a
    traceback and status -2 (Python ends an uncaught one by the signal), or was lost
    where Python only prints an exception (a weakref callback, a ``__del__``) and the
    command ran on. A command pressed so ends once the imports are done, before it
    starts, saying so (``_app.interrupted_at_start``)."""

    def __init__(self) -> None:
        self.presses = 0

    def __call__(self, signum: int, frame: object) -> None:
        self.presses += 1


@contextlib.contextmanager
def starting() -> Iterator[Starting]:
    """SIGINT goes to a ``Starting`` meanwhile, if it is Python's own handler and this
    is the main thread (one ignored, by a shell's background job, stays ignored; an
    embedding program's is its own). After a press it is ignored: the command ends,
    and a press landing in Python's teardown would end it by the signal (status -2)."""
    start = Starting()
    previous = signal.getsignal(signal.SIGINT)
    ours = previous is signal.default_int_handler
    if not ours or threading.current_thread() is not threading.main_thread():
        yield start
        return
    signal.signal(signal.SIGINT, start)
    try:
        yield start
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN if start.presses else previous)


class CtrlC:
    """Ctrl-C while a command's loop runs, taken by a SIGINT handler of its own.

    The first press asks the work to stop (``stop``), says at once what it did and what
    a second press would do (``said``: the work may have to wait for a statement on its
    way, and for another process's lock with it), and returns: the main thread goes on
    waiting for the coroutine to unwind. ``KeyboardInterrupt`` could not be trusted
    with it. Raised in ``Thread.join`` (Python 3.11 and 3.12) it marks the thread as
    ended while it runs, so the command printed its report and exited with its ledger
    still closing; and one raised where Python only prints an exception (a weakref
    callback, a ``__del__``: seen in the start-up's imports) is lost, the command going
    on as if no key had been pressed. A press before the loop can be stopped is
    counted: the loop stops as it starts. The
    second press raises ``KeyboardInterrupt``: the command ends at once. Once a press
    has ended the work, SIGINT is ignored: the process is ending, and a later press
    landing in Python's teardown (where SIGINT is the system's default again) ended it
    by the signal, status -2, instead of its exit code."""

    def __init__(self, said: Callable[[], object] | None = None) -> None:
        self.presses = 0
        self.stop: Callable[[], object] | None = None  # set once the loop runs
        self.said = said

    def __call__(self, signum: int, frame: object) -> None:
        self.presses += 1
        if self.presses > 1:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            raise KeyboardInterrupt
        if self.stop is not None:
            self.stop()
        if self.said is not None:
            # the main thread only waits in ``join`` meanwhile: it is writing nothing
            with contextlib.suppress(OSError):  # stderr gone: the stop still holds
                self.said()


@contextlib.contextmanager
def _taking(ctrl_c: CtrlC) -> Iterator[None]:
    """SIGINT goes to ``ctrl_c`` meanwhile, then back (unless it is ignored: a command
    started in the background by a shell keeps ignoring it)."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, ctrl_c)
    try:
        yield
    finally:
        if ctrl_c.presses < 2:  # after a second one, the ending process ignores it
            signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


def drive(fn: Callable[[], Awaitable[T]], *, said: Callable[[], object] | None = None) -> T:
    """``fn()`` run to its end, or ``KeyboardInterrupt`` at a second Ctrl-C, or once the
    coroutine has unwound after the first (``cli._common.run_sync`` reports it).
    ``said()`` runs at the first Ctrl-C, at once: it tells the operator what that press
    did and what a second would do."""

    async def plain() -> T:
        return await fn()

    if threading.current_thread() is not threading.main_thread():
        return anyio.run(plain)  # no signals here (a command run from another thread)

    outcome: list[tuple[bool, Any]] = []  # (True, result) or (False, exception)
    ctrl_c = CtrlC(said)

    async def main() -> None:
        work = anyio.CancelScope()
        ctrl_c.stop = functools.partial(_soon, asyncio.get_running_loop(), work.cancel)
        if ctrl_c.presses:  # pressed before the loop ran (read after ``stop`` is set)
            work.cancel()
        with work:
            outcome.append((True, await fn()))

    def loop() -> None:
        try:
            anyio.run(main)
        except BaseException as exc:  # handed to the main thread, raised there
            outcome.append((False, exc))

    with _taking(ctrl_c):
        thread = threading.Thread(target=loop, name="stopline command", daemon=True)
        thread.start()
        thread.join()  # the whole unwinding; a second Ctrl-C raises KeyboardInterrupt here
    if not outcome:  # cancelled by the first Ctrl-C before it finished: the command ends
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # while it reports and the process ends
        raise KeyboardInterrupt
    done, value = outcome[0]
    if not done:
        raise value
    result: T = value
    return result
