"""A cancel the ledger holds back while a write finishes, delivered again.

``Writer.submit`` lets a cancelled caller learn the outcome of a job that
finishes within its grace (a gate's intent, once durable, is never left unknown
to its caller); a write that must not be cut (an outcome, a group transaction
holding other callers' writes) is waited for to its end (``held_to_the_end``).
A cancel scope's cancel (anyio's, trio's) is delivered again at the caller's
next await by itself; asyncio's own ``Task.cancel()``, which no shield holds,
is delivered once: taken while the write finishes, it is asked for again here.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import sniffio

__all__ = ["REARMED", "ask_again", "held_to_the_end", "holding", "redelivery", "surface_rearmed"]


def redelivery(cancel: BaseException) -> Callable[[], None]:
    """How to deliver again a cancel that ``Writer.submit`` holds back while a job finishes.

    A cancel scope's (anyio's, trio's) is delivered again at the caller's next await by
    itself. asyncio's own ``Task.cancel()`` (Ctrl-C under ``asyncio.run``, a framework's
    cancel of its task) is delivered once: held back, it was lost, and the task went on
    (a loop of runs finished all of them). It is asked for again, counted once."""
    if sniffio.current_async_library() != "asyncio":
        return lambda: None
    if anyio.current_effective_deadline() == -math.inf:  # a cancelled scope: it repeats
        return lambda: None
    return lambda: ask_again(cancel)


def ask_again(cancel: BaseException, times: int = 1) -> None:
    """asyncio's own cancel of this task, delivered ``times`` times and taken while a
    write finished, asked for again: raised at the task's next await (or when it ends),
    its count (``Task.cancelling``: what ``asyncio.timeout`` reads) as it was."""
    task = asyncio.current_task()
    if task is None:
        return
    for _ in range(times):
        task.uncancel()
        task.cancel(*cancel.args)
    REARMED.add(task)


# per task: asyncio's own cancels taken while a write it must finish runs (``holding``)
_HOLDING: weakref.WeakKeyDictionary[asyncio.Task[Any], list[BaseException]] = (
    weakref.WeakKeyDictionary()
)


@contextlib.contextmanager
def holding() -> Iterator[list[BaseException]]:
    """Where asyncio's own cancels of this task, taken while a write it must finish runs,
    are kept; they are asked for again (``ask_again``) when the outermost such write ends:
    an inner one asking at once would cut the outer one at its next await (a group
    transaction's leader, writing its jobs one by one after the group failed)."""
    task = asyncio.current_task() if sniffio.current_async_library() == "asyncio" else None
    outer = None if task is None else _HOLDING.get(task)
    if task is None or outer is not None:
        yield [] if outer is None else outer
        return
    held = _HOLDING[task] = []
    try:
        yield held
    finally:
        del _HOLDING[task]
        if held:
            ask_again(held[0], len(held))


async def held_to_the_end(wait: Callable[[], Awaitable[object]]) -> None:
    """``wait()`` to its end, whatever cancels the caller. A scope's cancel waits (a
    shield) and reaches the caller at its next await by itself. asyncio's own, which a
    shield does not hold, cuts the wait: it is taken, the wait resumed (``wait`` must
    be one that can be awaited again), and asked for again once it ends (``holding``)."""
    with holding() as held, anyio.CancelScope(shield=True):
        while True:
            try:
                await wait()
                break
            except anyio.get_cancelled_exc_class() as cancel:  # shielded: asyncio's own
                held.append(cancel)


# tasks whose held-back cancel was asked for again: it surfaces at their next await,
# which is often the next ``Writer.submit``'s wait, where it would be held back again (a loop
# of runs went on to its end); that ``Writer.submit`` surfaces it first, before queueing
REARMED: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()


async def surface_rearmed() -> None:
    if not REARMED:  # none asked for again
        return
    try:
        task = asyncio.current_task()
    except RuntimeError:  # off asyncio (trio): asyncio's tasks of an earlier loop are not this
        return
    if task is not None and task in REARMED:
        REARMED.discard(task)
        await asyncio.sleep(0)  # raises the cancel asked for again, if still pending
