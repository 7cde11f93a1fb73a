"""A call the model asks for again while an earlier one of the same entry is in doubt
(ADR 0097): one rule for every adapter, applied by ``gated_call``.

A framework tells the model a call failed (the Agents SDK's ``timeout=`` cut it,
a tool raised and the SDK or ``ToolNode`` made the error a message), while
stopline records it ``unknown``: its effect may have happened. The model asks
again under a new call id, in the same entry of the run. ``Bound.key_for``
matches only calls recorded by earlier entries (a resume), so that repeat was a
new operation: a second effect of something that may have happened, sent under
another idempotency key (R5, R14).

Here a call of this entry that ended without an answer for the model (it raised
out of the gate: recorded ``unknown``, ``not_committed`` or in review) is *open*:
the next call of the same tool with the same arguments (the digest the gate
records) takes its key, and the gate does with it what it does with any call of a
recorded key: a committed one is replayed, one in doubt is read back first
(``Run``: R5), sent again under the same key only when proved ``not_committed``,
and otherwise refused with ``OperationInDoubt`` (nothing sent), which an adapter
tells the model as ``in_doubt_note``. Once the model has had an answer for it,
the call is no longer open: a further identical call is a new operation, as
before. Calls with other arguments, and identical calls made while the first is
still running (one message asking twice), are unchanged.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from stopline.domain.model import args_digest
from stopline.domain.vocab import OpStatus
from stopline.errors import NotFound, UnstableValue
from stopline.integrations._replayed import said_of

if TYPE_CHECKING:
    from stopline.integrations._frameworks import Bound
    from stopline.runtime.ledger import Ledger

__all__ = ["Open", "in_doubt_note", "open_calls"]


class Open:
    """The calls of one entry of a run that ended without an answer, by (tool, digest)."""

    def __init__(self, bound: Bound) -> None:
        self.bound = bound
        self._keys: dict[tuple[str, str], list[str]] = {}

    async def key_for(self, tool: str, key: str | None, args: Any) -> str | None:
        """The key of a call of ``tool`` with the arguments ``args`` (``[args, kwargs]``,
        as the gate digests them): that of an open call it repeats, else its own (or the
        earlier entry's, ``Bound.key_for``)."""
        bound = self.bound
        key = bound.key_for(tool, key, args)
        same = self._keys.get((tool, _digest(args)), [])
        if key is None or not same or key in same:
            return key
        try:  # a call id the run has recorded is that call again: its own key
            await bound.ledger.backend.get_operation(f"{bound.run.id}/{key}")
            return key
        except NotFound:
            pass
        for earlier in same:
            op = await bound.ledger.backend.get_operation(f"{bound.run.id}/{earlier}")
            if op.status is not OpStatus.PREVENTED:  # fenced: the run is cancelled
                return earlier
        return key

    def ended(self, tool: str, key: str | None, args: Any, *, answered: bool) -> None:
        """The call under ``key`` ended: with an answer for the model, or without one."""
        digest = _digest(args)
        if key is None or not digest:
            return
        same = self._keys.setdefault((tool, digest), [])
        if answered:
            if key in same:
                same.remove(key)
        elif key not in same:
            same.append(key)

    @contextlib.asynccontextmanager
    async def calling(self, tool: str, key: str | None, args: Any) -> AsyncIterator[str | None]:
        """The block of one call: its key (``key_for``); ended answered when the block
        returns, open when it raises (the model is told it failed)."""
        key = await self.key_for(tool, key, args)
        answered = False
        try:
            yield key
            answered = True
        finally:
            self.ended(tool, key, args, answered=answered)


# one per entry of a run (a ``Bound``), whichever agent, node or guardrail makes the call
_OPEN: weakref.WeakKeyDictionary[Bound, Open] = weakref.WeakKeyDictionary()


def open_calls(bound: Bound) -> Open:
    """The open calls of ``bound``'s entry."""
    found = _OPEN.get(bound)
    if found is None:
        found = _OPEN[bound] = Open(bound)
    return found


def _digest(args: Any) -> str:
    """The digest the gate records of a call's arguments; ``""`` when it has none."""
    try:
        return args_digest(args)
    except UnstableValue:
        return ""


async def in_doubt_note(
    ledger: Ledger, tool: str, op_id: str, *, when: str = "earlier in this run"
) -> str:
    """The model's answer for a call that repeats one in doubt, or in review (nothing
    was sent): what its record proves and what settles it, in its receipt's words
    (``said_of``, the one wording of each status: a call still running settles by its
    own answer, one whose answer was lost by a read-back, one in review by a reviewer;
    one whose correction failed happened). Every adapter's, and a LangGraph thread's
    for a call of an earlier run (``when``), ADR 0112, ADR 0113."""
    op = await ledger.backend.get_operation(op_id)
    said = said_of((await ledger.receipt(op.run_id)).lines, op_id) or op.status.value
    return (
        f"{tool} was called {when} with the same arguments ({op_id}) and was not sent "
        f"again, so that it cannot happen twice. The ledger records it {said}. Do not "
        "call it again for the same request; report it as the ledger records it."
    )
