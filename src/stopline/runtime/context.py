"""What a tool sees of its own call: its idempotency key, and how to report."""

from __future__ import annotations

import decimal
import math
import numbers
import reprlib
import time
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any

import anyio

from stopline.domain.limits import sanitise
from stopline.domain.model import Evidence, horizon_evidence
from stopline.domain.vocab import EvidenceKind, NoteKind, OpEvent
from stopline.ledger.backend import OutcomeUpdate
from stopline.runtime.boundary import log, quietly, retryable

if TYPE_CHECKING:
    from stopline.runtime.core import Core
    from stopline.runtime.tool import Tool

__all__ = ["CallContext", "Recording"]


class Recording:
    """A write the runtime makes in the background; awaiting it waits until it is
    done, and raises the error that stopped it."""

    __slots__ = ("_done", "_error")

    def __init__(self, done: anyio.Event | None) -> None:
        self._done = done  # None: nothing to write
        self._error: Exception | None = None

    async def write(
        self, note: Callable[..., Awaitable[object]], op_id: str, data: dict[str, object]
    ) -> None:
        assert self._done is not None
        try:
            await note(op_id, NoteKind.HORIZON_STATED, data)
        except Exception as exc:
            if retryable(exc):
                raise  # the error boundary tries again when the ledger may take it
            self._error = exc  # the bound still holds here; an awaiting tool hears it
        self._done.set()

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()

    async def _wait(self) -> None:
        if self._done is not None:
            await self._done.wait()
        if self._error is not None:
            raise self._error


class CallContext:
    """Handed to an effectful tool as ``ctx``; also to its cancel and verify."""

    __slots__ = (
        "_accepted",
        "answered",
        "attempt",
        "canceller",
        "core",
        "cut_sends",
        "lost_recorded",
        "op_id",
        "provider_ref",
        "run_id",
        "started_at",
        "stated_horizon",
        "tool",
    )

    def __init__(
        self, core: Core, run_id: str, op_id: str, tool: Tool[object], attempt: int = 1
    ) -> None:
        # the runtime of the ledger this call runs in (for stopline's integrations: its
        # backend, its background work, its outcomes; not a stable API)
        self.core = core
        self.run_id = run_id
        self.op_id = op_id
        self.tool = tool
        self.attempt = attempt
        self.provider_ref = ""
        self._accepted = False
        self.started_at = time.time()  # when the call was dispatched (after the gate)
        self.stated_horizon: float | None = None
        # this call's own way to ask its provider to cancel, and the channel's name
        # (an integration's or a framework's native cancel); the tool's canceller else
        self.canceller: tuple[str, Callable[[], Awaitable[object]]] | None = None
        # the channel through which cutting this call's awaiting scope itself tells its
        # provider (an MCP call: the SDK sends the cancel); "" when a cut tells it nothing
        self.cut_sends = ""
        # interrupted by a cancel that recorded it already, with the rest of its tree
        self.lost_recorded = False
        # its tool has returned or raised: from here this process may record its outcome
        # (until then its operation stays unresolved, unless this worker is taken for
        # dead: what lets a cancel's notification skip its check, ADR 0041)
        self.answered = False

    @property
    def is_accepted(self) -> bool:
        """The provider acknowledged the request (``accepted`` was called)."""
        return self._accepted

    @property
    def key(self) -> str:
        """The idempotency key to hand to the provider: the operation's id."""
        return self.op_id

    def settles_by(self, at: float) -> Recording:
        """The provider states the latest moment (epoch seconds) by which this call's
        effect lands or never will (R13); the earliest stated bound wins.

        It holds at once for this process, and is written to the ledger in the
        background so that it holds after a crash too (recovery gives it to the
        operation it marks ``unknown``). ``await ctx.settles_by(at)`` returns once it
        is written, and raises the ledger's error if it could not be."""
        if self.stated_horizon is not None and at >= self.stated_horizon:
            return Recording(None)
        self.stated_horizon = at
        recording = Recording(anyio.Event())
        data = {"evidence": [horizon_evidence(at).to_json()]}
        self.core.spawn(recording.write, self.core.backend.note, self.op_id, data)
        return recording

    def cancel_via(
        self, channel: str, ask: Callable[[], Awaitable[object]], *, on_cut: bool = False
    ) -> None:
        """How to ask this call's provider to cancel it (the runtime hook an integration
        uses for its interface's native cancel). ``ask`` returns what the provider
        answered, as a tool's canceller does; ``channel`` names the way, for the ledger.
        ``on_cut``: cutting the call's awaiting scope sends that same cancel by itself
        (so a cut call's provider was asked, whatever its policy says: R14)."""
        self.canceller = (channel, ask)
        self.cut_sends = channel if on_cut else ""

    def horizon(self, ended_at: float) -> float:
        """R13: the latest moment this call's effect could still land, for a call whose
        local side ended at ``ended_at``: the earliest bound stated by the provider or
        declared by the tool (``settles_within`` after dispatch); with neither, the end
        of the local call (an in-process effect cannot land after its code stopped)."""
        bounds = [b for b in (self.stated_horizon, self._declared()) if b is not None]
        return min(bounds) if bounds else ended_at

    def _declared(self) -> float | None:
        within = self.tool.settles_within
        return None if within is None else self.started_at + within

    async def accepted(self, ref: str = "", detail: str = "") -> None:
        """The provider acknowledged the request (recorded before this returns)."""
        if self._accepted:
            return
        self._accepted = True
        if ref:
            self.provider_ref = ref
        evidence = [Evidence(EvidenceKind.PROVIDER_RECEIPT, ref or "accepted", detail)]
        await self.core.outbox.record(self.op_id, OutcomeUpdate(OpEvent.ACCEPTED, evidence))

    async def progress(
        self, progress: float, total: float | None = None, message: str = ""
    ) -> None:
        """Progress is advisory: it is recorded (a ``progress`` event on the operation)
        and never proves a commit, so it never fails the call it reports on.

        What the tool gives is recorded as every backend can store it and every
        surface can show it, and nothing here raises into the tool (but a cancel of
        its scope): ``message`` as ``sanitise`` makes free text (control characters
        and lone surrogates replaced, at most 4,096 characters); ``progress`` and
        ``total`` as given when each is a real, finite number (``None`` too for
        ``total``), else as a short text of what was given (``"nan"``, ``"'half'"``),
        for a reader to see the tool's mistake. An error of the ledger writing it is
        logged on ``stopline.background``: the call goes on, and its outcome is
        written as ever (a tool stopped by its own report left an effect that went on
        recorded ``unknown``)."""
        data = {
            "progress": _amount(progress),
            "total": None if total is None else _amount(total),
            "message": sanitise(message if isinstance(message, str) else _shown(message)),
        }
        with quietly(f"recording progress of {self.op_id!r}", log):
            await self.core.backend.note(self.op_id, NoteKind.PROGRESS, data)


# a value a tool gave where a number was wanted, as a short text (nesting and length
# bounded, an object whose ``repr`` raises named by its type: it never raises itself)
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 60, 60


def _shown(value: object) -> str:
    try:
        return _SHORT.repr(value)
    except Exception:  # a container whose ``len`` or items raise, say
        return f"<{type(value).__name__}>"


def _amount(value: object) -> float | str:
    """A reported amount as the event keeps it: a real, finite number as it is (an
    integer as an integer), anything else as ``_shown`` text. ``NaN`` and infinity are
    not JSON (PostgreSQL's ``jsonb`` and most readers refuse them), an integer past a
    float's range is infinity to most readers, and a nested list failed the write."""
    try:
        if isinstance(value, numbers.Real | decimal.Decimal) and not isinstance(value, bool):
            number = float(value)
            if math.isfinite(number):
                return int(value) if isinstance(value, numbers.Integral) else number
    except Exception:  # a number type whose ``float`` raises, past the range too
        pass
    return sanitise(_shown(value), at_most=64)
