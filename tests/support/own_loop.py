"""A framework's ``run_sync`` in a worker thread, with an event loop of the thread's
own that is closed after."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def in_own_loop(call: Callable[[], object]) -> None:
    """``call`` (a framework's ``run_sync``) in a worker thread, with an event loop of the
    thread's own that is closed after: the framework takes the thread's loop and never
    closes it, and a loop left open is a ``ResourceWarning`` in whichever test collects it."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        call()
    finally:
        asyncio.set_event_loop(None)
        loop.close()
