"""Named points where a test holds a workflow, acts, then lets it go.

barriers = Barriers()
hold = barriers.hold("accepted")      # the next call to reach "accepted" stops there
...                                   # start the workflow
await hold.reached.wait()             # it is there, deterministically
await ledger.cancel(run_id, by="t")   # act
hold.release()                        # let it go on

A point has at most one hold waiting: a second ``hold(point)`` before the first
was reached raises ``BarrierInUse`` (it would otherwise replace the first, and
the test wait on a barrier nobody reaches). Once reached, the point may be held
again for a later call. ``release_all()`` lets go every hold: those waiting and
the calls already stopped at one. A point its owner says no call reaches
(``never_reached``: a ``FakeProvider`` dropping its responses never reaches
``responding``) refuses a hold with ``InvalidInput`` saying why.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from stopline.errors import InvalidInput, StoplineError

__all__ = ["Barrier", "BarrierInUse", "Barriers"]


class BarrierInUse(StoplineError):
    """A point already has a hold waiting for its next call."""


class Barrier:
    def __init__(self, point: str) -> None:
        self.point = point
        self.reached = anyio.Event()
        self._released = anyio.Event()
        self.key: str | None = None  # the idempotency key of the call that reached it

    def release(self) -> None:
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    async def wait_released(self) -> None:
        await self._released.wait()


class Barriers:
    """One-shot holds by point name; a point with no hold passes straight through."""

    def __init__(self) -> None:
        self._holds: dict[str, Barrier] = {}  # holds waiting for a call
        self._reached: list[Barrier] = []  # holds a call stopped at, not yet released
        self.passed: list[tuple[str, str]] = []  # (point, key), in order
        # called as each point is reached, before its hold is looked up: an observer
        # (the explorer) may install a hold for this very call from here
        self.on_reach: Callable[[str, str], None] | None = None
        self._never: dict[str, str] = {}  # point -> why no call reaches it now

    def hold(self, point: str) -> Barrier:
        """Stop the next call to reach ``point`` there, until released."""
        if not isinstance(point, str) or not point:  # a call reaches a point by its name
            raise InvalidInput("point", f"{point!r}: a point is named by a non-empty str")
        if point in self._never:  # a hold nobody reaches: the test would wait for ever
            raise InvalidInput("point", f"{point!r}: {self._never[point]}")
        if point in self._holds:
            raise BarrierInUse(
                f"{point!r} already has a hold waiting for its next call: wait for it "
                "to be reached (or release it) before holding the point again"
            )
        barrier = self._holds[point] = Barrier(point)
        return barrier

    def never_reached(self, point: str, why: str | None) -> None:
        """Say that no call reaches ``point`` now, and ``why`` (a later ``hold`` of it is
        refused, naming why); ``None``: calls reach it again. Refused (``InvalidInput``)
        while a hold of it waits: that hold would never be reached."""
        if why is not None and point in self._holds:
            raise InvalidInput(
                "point", f"a hold of {point!r} waits for a call, and {why}: release it first"
            )
        if why is None:
            self._never.pop(point, None)
        else:
            self._never[point] = why

    def release_all(self) -> None:
        """Release every hold: those waiting (their call passes straight through) and
        those a call is stopped at."""
        for barrier in [*self._holds.values(), *self._reached]:
            barrier.release()
        self._reached.clear()

    async def reach(self, point: str, key: str, *, unless: anyio.Event | None = None) -> None:
        """Stop here if a test holds ``point``, until released (or ``unless`` is set)."""
        self.passed.append((point, key))
        if self.on_reach is not None:
            self.on_reach(point, key)
        barrier = self._holds.pop(point, None)
        if barrier is None:
            return
        barrier.key = key
        barrier.reached.set()
        self._reached.append(barrier)
        try:
            if unless is None:
                await barrier.wait_released()
                return
            async with anyio.create_task_group() as tg:

                async def stop_on(event: anyio.Event) -> None:
                    await event.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(stop_on, unless)
                await barrier.wait_released()
                tg.cancel_scope.cancel()
        finally:
            if barrier in self._reached:
                self._reached.remove(barrier)
