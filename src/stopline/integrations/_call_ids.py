"""A framework's call ids within one entry of a run (ADR 0054, ADR 0068).

An id names one operation of the run: the same id with the same arguments is
that call again (its recorded outcome), the same id with other arguments is
refused before anything is sent (``refused_replay``). That must not depend on
timing: a model that emits one id twice in a message makes the framework run
both calls at once (LangGraph's ``ToolNode``, Pydantic AI and the Agents SDK
run a message's calls concurrently). ``CallIds.take`` makes the second wait
for the first to finish, so it meets the first one's record at the gate, as it
would had they run one after the other; without it the second met an
operation still in flight and failed as "in doubt".

A gated call reached again inside itself (two gates around one call: a
wrapper stopline did not see through) would wait for itself for ever: it is
refused with ``InvalidInput`` naming the double gate instead.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncIterator, Callable, Iterator

import anyio

from stopline.errors import IdempotencyConflict, InvalidInput, NotReplayable

__all__ = ["CallIds", "inside", "refused_replay", "unkept_note"]

# the keys of the gated calls this context runs inside (a call's own body included)
_INSIDE: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "stopline_framework_calls_inside", default=frozenset()
)


class CallIds:
    """The keys of the calls in flight in one entry of a run: one call per key at a time."""

    def __init__(self) -> None:
        self._running: dict[str, anyio.Event] = {}

    async def take(self, key: str | None, tool: str) -> Callable[[], None]:
        """Wait until no call of ``key`` is in flight, then hold it; returns the release
        (idempotent). A key held by the calls this context runs inside is refused."""
        if key is None:
            return lambda: None
        if key in _INSIDE.get():
            raise InvalidInput(
                "tools",
                f"the {tool} call {key!r} is reached again inside itself: it passes two "
                "stopline gates (a wrapper around a gated tool or toolset: give it one), "
                "or a call made inside it reuses its id (ADR 0068)",
            )
        while (running := self._running.get(key)) is not None:
            await running.wait()
        done = self._running[key] = anyio.Event()

        def release() -> None:
            if self._running.get(key) is done:
                del self._running[key]
            done.set()

        return release

    @contextlib.asynccontextmanager
    async def one_at_a_time(self, key: str | None, tool: str) -> AsyncIterator[None]:
        """``take`` the key for the block, which runs ``inside`` it."""
        release = await self.take(key, tool)
        try:
            with inside(key):
                yield
        finally:
            release()


@contextlib.contextmanager
def inside(key: str | None) -> Iterator[None]:
    """The block (and the tasks and threads it starts) runs the gated call of ``key``."""
    if key is None:
        yield
        return
    token = _INSIDE.set(_INSIDE.get() | {key})
    try:
        yield
    finally:
        _INSIDE.reset(token)


def refused_replay(refused: IdempotencyConflict | NotReplayable, key: str | None, tool: str) -> str:
    """What the gate's refusal of a framework's call means to the adapter: a key naming
    another recorded call was reused by the framework (raised, ADR 0054); a call whose
    result was not kept answers with ``unkept_note``."""
    if isinstance(refused, NotReplayable):
        return unkept_note(tool, refused.why)
    if key is None:
        raise refused
    raise InvalidInput(
        "tool call id",
        f"{key!r} (a {tool} call) reuses the id of an earlier call of this run with "
        "other arguments: the model (or the history handed back) reused a call id; "
        "nothing was sent, and stopline does not guess which call it is (ADR 0054)",
    ) from refused


def unkept_note(tool: str, why: str) -> str:
    """A tool's answer for the model when the call happened but its result was not kept."""
    return (
        f"{tool} was done earlier in this run; its result was not kept ({why}). "
        "Do not call it again for the same request."
    )
