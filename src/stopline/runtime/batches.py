"""Requests from many tasks served together: one read or one transaction for many.

A cancelled tree of 10,000 runs settles 10,000 runs and verifies 10,000
calls at about the same moment. Each step is small (read a run, write its
move), but each is its own job on the ledger's writer, and the job, not the
rows, is what costs: its hop between threads, and the event loop's turn.
``Batches`` serves every request made while a batch is being served in the
next batch, by one task, one batch after another: a lone request is served
at once, as before, and a crowd pays one job per batch.

While the ledger is closing no task can be started, and a request is served
by its own caller, alone: what it waits for is done or fails as it did
before batching.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

import anyio

if TYPE_CHECKING:
    from stopline.runtime.core import Core

__all__ = ["Batches"]

T = TypeVar("T")
R = TypeVar("R")


@dataclasses.dataclass(eq=False)
class _Batch(Generic[R]):
    """The requests one batch takes; ``results`` is None until it was served (and stays
    None if it was not: its task was cancelled as the ledger closes). Each caller waits
    on its own event: 10,000 waiters of one ``asyncio.Event`` cost O(n) each to remove."""

    waiting: list[anyio.Event] = dataclasses.field(default_factory=list)
    results: Sequence[R | Exception] | None = None

    def done(self) -> None:
        for event in self.waiting:
            event.set()


class Batches(Generic[T, R]):
    """``serve(items)`` returns a result for each item, in order: the item's answer, or
    the error it raises (an error of the whole batch is every item's)."""

    def __init__(
        self, core: Core, serve: Callable[[list[T]], Awaitable[Sequence[R | Exception]]]
    ) -> None:
        self._core = core
        self._serve = serve
        self._items: list[T] = []  # asked for since the batch being served began
        self._next: _Batch[R] = _Batch()
        self._serving = False

    async def one(self, item: T) -> R:
        """``item`` served, in the next batch; its error raised."""
        result = (await self.many([item]))[0]
        if isinstance(result, Exception):
            raise result
        return result

    async def many(self, items: Sequence[T]) -> list[R | Exception]:
        """``items`` served, in the next batch, each with its result or error."""
        if not items:
            return []
        if not self._serving:
            if not self._core.running:  # the ledger is closing: no task can serve them
                return list(await self._served(list(items)))
            self._serving = True
            self._core.spawn(self._serve_all)
        batch, at, done = self._next, len(self._items), anyio.Event()
        self._items.extend(items)
        batch.waiting.append(done)
        await done.wait()
        if batch.results is None:  # its task was cancelled (the ledger closes): alone
            return list(await self._served(list(items)))
        return list(batch.results[at : at + len(items)])

    async def _serve_all(self) -> None:
        """Serve batches until none is waiting."""
        try:
            while self._items:
                batch, self._next = self._next, _Batch()
                items, self._items = self._items, []
                try:
                    batch.results = await self._served(items)
                finally:
                    batch.done()  # cancelled: not served; its callers serve their own
        finally:
            self._serving = False
            self._next.done()  # asked for after the last batch: served by their callers
            self._next, self._items = _Batch(), []

    async def _served(self, items: list[T]) -> Sequence[R | Exception]:
        try:
            results = await self._serve(items)
        except Exception as exc:
            return [exc] * len(items)
        if len(results) != len(items):
            raise AssertionError(f"{len(items)} requests were served {len(results)} results")
        return results
