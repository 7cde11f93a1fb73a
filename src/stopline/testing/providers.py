"""A fake remote provider with its own ground truth, barriers and faults.

``FakeProvider`` plays an external system (a payments API, a chat service):
it keeps what it really committed (``committed``, ``effects``), stops at the
barriers ``received``, ``accepted``, ``committed`` and ``responding``, and
injects the faults the contract is about: refuse a cancel, be unable to
cancel once accepted, drop the connection after committing, answer late,
carry out a request whose caller has gone (``outlives_caller``).
Its ``tool`` is a ``stopline.Tool`` declaring exactly what it can do.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Collection
from typing import Any, TypeVar

import anyio

from stopline.domain.limits import check_id
from stopline.domain.vocab import Cancellable
from stopline.errors import InvalidInput
from stopline.runtime.context import CallContext
from stopline.runtime.tool import ReadBack, Rejected, Tool, Verdict
from stopline.testing.barriers import Barriers

__all__ = ["POINTS", "CancelBehaviour", "FakeProvider", "in_runs"]

# the points a call passes at the provider, in order (``hold`` takes these)
POINTS = ("received", "accepted", "committed", "responding")
# its lists of keys, in the order things happened (``of_run`` reads these)
KEY_LISTS = (
    "requests",
    "effects",
    "cancel_requests",
    "refused",
    "dropped",
    "compensated",
    "landed",
)


class CancelBehaviour(enum.Enum):
    CONFIRM = "confirm"  # cancels when it still can, and says so
    REFUSE = "refuse"  # answers the cancel with a refusal and goes on


E = TypeVar("E", bound=enum.Enum)


def _member(kind: type[E], what: str, value: object) -> E:
    """``value`` as a member of ``kind`` (its value, ``"refuse"``, is one too)."""
    try:
        return kind(value)
    except ValueError:
        names = ", ".join(repr(m.value) for m in kind)
        raise InvalidInput(what, f"{value!r}: one of {kind.__name__}: {names}") from None


class FakeProvider:
    def __init__(
        self,
        name: str,
        *,
        cancellable: Cancellable = Cancellable.UNTIL_ACCEPTED,
        on_cancel: CancelBehaviour = CancelBehaviour.CONFIRM,
        verifiable: bool = True,
        drop_response: bool = False,
        compensable: bool = False,
        outlives_caller: bool = False,
        description: str = "",
    ) -> None:
        # a fault plan is checked when made: "yes" was a cancellable that failed mid-run
        # (blamed on the workflow), "maybe" a cancel behaviour that quietly confirmed
        self.name = check_id("provider name", name)
        cancellable = _member(Cancellable, "cancellable", cancellable)
        on_cancel = _member(CancelBehaviour, "on_cancel", on_cancel)
        for what, flag in (
            ("verifiable", verifiable),
            ("drop_response", drop_response),
            ("compensable", compensable),
            ("outlives_caller", outlives_caller),
        ):
            if not isinstance(flag, bool):
                raise InvalidInput(what, f"{flag!r}: must be True or False")
        if not isinstance(description, str):
            raise InvalidInput("description", f"must be a string, not {type(description).__name__}")
        self.barriers = Barriers()
        self.on_cancel = on_cancel
        self._drop_response = False
        self.drop_response = drop_response
        # a request it holds when its caller goes away (the worker died, the call was
        # cut) is carried out all the same, as a remote provider's would be
        self.outlives_caller = outlives_caller
        self.landed: list[str] = []  # keys committed after their caller had gone
        self.requests: list[str] = []  # every request that reached the provider
        self.committed: dict[str, Any] = {}  # ground truth: key -> what was done
        self.effects: list[str] = []  # every commit, so a duplicate effect shows
        self.cancel_requests: list[str] = []
        self.refused: list[str] = []  # keys whose cancel this provider refused
        self.dropped: list[str] = []  # keys whose response the dropped connection lost
        self._calls: dict[str, int] = {}  # key -> its calls in progress (retries overlap)
        # key -> its cancel, while a call of it is in progress, and for good once set
        self._cancelled: dict[str, anyio.Event] = {}
        self.late: list[tuple[str, Any]] = []  # responses nobody was waiting for
        self.compensated: list[str] = []  # keys whose effect was corrected
        # per list of keys: (the list indexed, how much of it, its keys by run)
        self._by_run: dict[str, tuple[list[str], int, dict[str, list[str]]]] = {}
        self.tool: Tool[Any] = Tool(
            self._call, name=name, description=description or name, cancellable=cancellable
        )
        self.tool.wants_context = True
        if cancellable is not Cancellable.NEVER:
            self.tool.cancel_fn = self._cancel
        if verifiable:
            self.tool.verify_fn = self._verify
        if compensable:
            self.tool.compensate_fn = self._compensate

    def of_run(self, which: str, run_id: str) -> list[str]:
        """The keys in ``which`` (one of ``KEY_LISTS``: ``"requests"``, ``"effects"``,
        ``"cancel_requests"``, ...) that are run ``run_id``'s (a key is its operation's
        id, ``<run id>/...``), in order. Indexed as the list grows: judging each of many
        runs reads that run's keys, not every key the provider saw (the soak's checks of
        20,000 runs a worker took over ten minutes that way). A run id may hold ``/``: a
        key is filed under each prefix it could be the run of."""
        if which not in KEY_LISTS:  # "name" was its characters; "efects" AttributeError
            names = ", ".join(map(repr, KEY_LISTS))
            raise InvalidInput("which", f"{which!r}: one of a FakeProvider's key lists: {names}")
        keys: list[str] = getattr(self, which)
        indexed, done, index = self._by_run.get(which, (None, 0, {}))
        if indexed is not keys or done > len(keys):
            done, index = 0, {}
        for key in keys[done:]:
            at = key.find("/")
            while at != -1:
                index.setdefault(key[:at], []).append(key)
                at = key.find("/", at + 1)
        self._by_run[which] = (keys, len(keys), index)
        return index.get(run_id, [])

    def of_runs(self, which: str, run_ids: Collection[str]) -> list[str]:
        """``of_run`` of each of ``run_ids`` (a run and the child runs it owns: their
        operations are the run's too), run by run."""
        if isinstance(run_ids, str):  # its characters were run ids: nothing matched
            raise InvalidInput("run_ids", f"{run_ids!r} is one id: give a collection ([id])")
        return [key for run_id in dict.fromkeys(run_ids) for key in self.of_run(which, run_id)]

    @property
    def drop_response(self) -> bool:
        """The connection drops once the effect is committed, before the response: the
        call raises ``ConnectionResetError`` at ``committed`` and never reaches
        ``responding`` (a hold of it is refused then, naming why)."""
        return self._drop_response

    @drop_response.setter
    def drop_response(self, drop: bool) -> None:
        if not isinstance(drop, bool):
            raise InvalidInput("drop_response", f"{drop!r}: must be True or False")
        why = (
            "this provider drops its responses (drop_response=True): its calls raise "
            "after 'committed' and never reach 'responding' (hold 'committed')"
        )
        self.barriers.never_reached("responding", why if drop else None)
        self._drop_response = drop

    def hold(self, point: str) -> Any:
        """Hold the next call at ``received``, ``accepted``, ``committed`` or ``responding``.

        Another name is refused (``InvalidInput``): no call would ever reach it, and a
        test waiting for it to be reached would wait for ever; so is ``responding``
        while the provider drops its responses."""
        if point not in POINTS:
            names = ", ".join(map(repr, POINTS))
            raise InvalidInput("point", f"{point!r}: a FakeProvider's calls pass {names}")
        return self.barriers.hold(point)

    async def _call(self, ctx: CallContext, payload: Any = None) -> dict[str, Any]:
        key = ctx.key
        self.requests.append(key)
        cancelled = self._cancelled.setdefault(key, anyio.Event())
        self._calls[key] = self._calls.get(key, 0) + 1
        try:
            if key in self.committed:  # idempotent by key: the recorded result, no new effect
                return {"id": key, "value": self.committed[key], "replayed": True}
            await self.barriers.reach("received", key, unless=cancelled)
            if cancelled.is_set():
                raise Rejected("cancelled before acceptance", ref=f"{self.name}:{key}")
            await ctx.accepted(ref=f"{self.name}:{key}")
            await self.barriers.reach("accepted", key, unless=cancelled)
            if cancelled.is_set():
                raise Rejected("cancelled after acceptance", ref=f"{self.name}:{key}")
            self.committed[key] = payload
            self.effects.append(key)
            await self.barriers.reach("committed", key)
            if self.drop_response:
                self.dropped.append(key)
                raise ConnectionResetError("connection dropped before the response")
            await self.barriers.reach("responding", key)
            return {"id": key, "value": payload}
        except BaseException as exc:
            # the caller went away (not an error of the provider's own): the request is
            # here, and a provider that outlives its caller carries it out, telling nobody
            gone = not isinstance(exc, Exception) and not cancelled.is_set()
            if gone and self.outlives_caller and key not in self.committed:
                self.committed[key] = payload
                self.effects.append(key)
                self.landed.append(key)
            raise
        finally:
            self._ended(key, cancelled)

    @property
    def in_progress(self) -> set[str]:
        """The keys with a call in progress now (until the last of overlapping ones ends)."""
        return set(self._calls)

    def _ended(self, key: str, cancelled: anyio.Event) -> None:
        """A call of ``key`` is over: the key is in progress until its last call is, and
        an event nobody set is dropped with it (one a call per key was kept for as long
        as the provider lived: a 15-minute soak's worker held ~60,000). A set one
        stays: a retry of a cancelled key is refused."""
        left = self._calls.pop(key) - 1
        if left:
            self._calls[key] = left
            return
        if not cancelled.is_set() and self._cancelled.get(key) is cancelled:
            del self._cancelled[key]

    async def _cancel(self, ctx: CallContext) -> bool:
        key = ctx.key
        self.cancel_requests.append(key)
        if self.on_cancel is CancelBehaviour.REFUSE or key in self.committed:
            self.refused.append(key)
            return False
        self._cancelled.setdefault(key, anyio.Event()).set()
        return True

    async def _verify(self, ctx: CallContext) -> ReadBack:
        key = ctx.key
        if key in self.committed:
            result = {"id": key, "value": self.committed[key]}
            return ReadBack(Verdict.COMMITTED, f"{self.name}:{key}", "found by key", result)
        if key in self._calls:
            return ReadBack(Verdict.UNKNOWN, detail="still in progress")
        return ReadBack(Verdict.NOT_COMMITTED, ref=f"{self.name}:{key}", detail="no such key")

    async def _compensate(self, ctx: CallContext) -> dict[str, Any]:
        """Correct a committed effect (once per key); the effect itself stays in ``effects``.

        The correction runs as its own operation (``<key>~compensate``) for ``key``."""
        key = ctx.key.partition("~")[0]
        if key not in self.committed:
            raise Rejected("nothing to correct", ref=f"{self.name}:{key}")
        if key not in self.compensated:
            self.compensated.append(key)
        return {"id": key, "compensated": True}

    async def respond_late(
        self, key: str, deliver: Callable[[str, Any], Awaitable[object]]
    ) -> None:
        """Deliver the recorded response of ``key`` to whoever still listens (R4).

        Refused (``InvalidInput``) for a key this provider committed nothing for: it
        has no response to deliver."""
        if key not in self.committed:
            raise InvalidInput("key", f"{key!r}: provider {self.name!r} committed nothing for it")
        response = {"id": key, "value": self.committed[key]}
        self.late.append((key, response))
        await deliver(key, response)


def in_runs(key: str, run_ids: Collection[str]) -> bool:
    """Whether ``key`` (an operation's id, ``<run id>/...``) is an operation of one of
    ``run_ids``; a run id may hold ``/``, so each prefix before one is tried."""
    at = key.find("/")
    while at != -1:
        if key[:at] in run_ids:
            return True
        at = key.find("/", at + 1)
    return False
