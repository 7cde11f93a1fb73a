"""A cancel the SQLite writer holds back while a job finishes, delivered again.

``Writer.submit`` lets a cancelled caller learn the outcome of a job that
finishes within its grace (a gate's intent, once durable, is never left unknown
to its caller). A cancel scope's cancel (anyio's, trio's) is delivered again at
the caller's next await by itself; asyncio's own ``Task.cancel()`` is not, and is
asked for again here.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import sniffio

__all__ = ["REARMED", "redelivery", "surface_rearmed"]


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
    task = asyncio.current_task()
    if task is None:
        return lambda: None

    def again() -> None:
        task.uncancel()
        task.cancel(*cancel.args)
        REARMED.add(task)

    return again


# tasks whose held-back cancel was asked for again: it surfaces at their next await,
# which is often the next ``Writer.submit``'s wait, where it would be held back again (a loop
# of runs went on to its end); that ``Writer.submit`` surfaces it first, before queueing
REARMED: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()


async def surface_rearmed() -> None:
    if not REARMED:  # none asked for again (always so off asyncio: no loop to ask)
        return
    task = asyncio.current_task()
    if task is not None and task in REARMED:
        REARMED.discard(task)
        await asyncio.sleep(0)  # raises the cancel asked for again, if still pending
