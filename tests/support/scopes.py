"""Which task cancels anyio's scopes: ``CancelScope.cancel`` observed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anyio


@contextmanager
def scope_cancels() -> Iterator[list[int | None]]:
    """The id of the task each ``CancelScope.cancel`` ran in while open, in order;
    ``None`` outside any task (on asyncio, a plain callback of the loop: ``outside_task``)."""
    scope_class = type(anyio.CancelScope())
    original = scope_class.cancel
    by: list[int | None] = []

    def cancel(self: anyio.CancelScope, reason: str | None = None) -> None:
        try:
            by.append(anyio.get_current_task().id)
        except RuntimeError:  # no task runs
            by.append(None)
        original(self, reason)

    scope_class.cancel = cancel  # type: ignore[method-assign]
    try:
        yield by
    finally:
        scope_class.cancel = original  # type: ignore[method-assign]
