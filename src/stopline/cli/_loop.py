"""A command's event loop, in a thread of its own, and the Ctrl-Cs that stop it.

``drive(fn)`` runs one coroutine on a fresh asyncio loop in a daemon thread while the
main thread waits for it and takes SIGINT with a handler of its own (``CtrlC``): the
first Ctrl-C cancels the coroutine's cancel scope and the command ends once it has
unwound (its ledger closed); a second ends it at once. A command a Ctrl-C ended
ignores SIGINT from then on, while it reports and the process ends (ADR 0109).
``cli._common.run_sync`` says what the command knows when it was stopped.
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

__all__ = ["CtrlC", "drive"]

T = TypeVar("T")


def _soon(loop: asyncio.AbstractEventLoop, call: Callable[[], object]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: nothing left to stop
        loop.call_soon_threadsafe(call)


class CtrlC:
    """Ctrl-C while a command's loop runs, taken by a SIGINT handler of its own.

    The first press asks the work to stop (``stop``) and returns: the main thread goes
    on waiting for the coroutine to unwind. ``KeyboardInterrupt`` could not be trusted
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

    def __init__(self) -> None:
        self.presses = 0
        self.stop: Callable[[], object] | None = None  # set once the loop runs

    def __call__(self, signum: int, frame: object) -> None:
        self.presses += 1
        if self.presses > 1:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            raise KeyboardInterrupt
        if self.stop is not None:
            self.stop()


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


def drive(fn: Callable[[], Awaitable[T]]) -> T:
    """``fn()`` run to its end, or ``KeyboardInterrupt`` at a second Ctrl-C, or once the
    coroutine has unwound after the first (``cli._common.run_sync`` reports it)."""

    async def plain() -> T:
        return await fn()

    if threading.current_thread() is not threading.main_thread():
        return anyio.run(plain)  # no signals here (a command run from another thread)

    outcome: list[tuple[bool, Any]] = []  # (True, result) or (False, exception)
    ctrl_c = CtrlC()

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
