"""A call the model asks for again while an earlier one is in doubt (ADR 0097).

The SDK's own ``timeout=`` of a function tool cuts the call: stopline records it
``unknown`` (its effect may have happened) and reads it back or has it reviewed.
The model, told the tool "timed out", asks again under a new call id, in the same
entry of the run. ``Bound.key_for`` matches only calls recorded by earlier entries
(a resume), so that repeat was a new operation: a second effect of something that
may have happened, sent under another idempotency key (R5, R14).

Here a call of this entry that ended without an answer for the model (cut by the
SDK's timeout, or raised: recorded ``unknown``, ``not_committed`` or in review) is
*open*: the next call of the same tool with the same arguments (the digest the
gate records) takes its key, and the gate does with it what it does with any call
of a recorded key: a committed one is replayed, one in doubt is read back first
(``Run``: R5), sent again under the same key only when proved ``not_committed``,
and otherwise refused with ``OperationInDoubt``, which the model reads as
``in_doubt_note`` (nothing was sent). Once the model has had an answer for it,
the call is no longer open: a further identical call is a new operation, as
before. Calls with other arguments, and identical calls made while the first is
still running (one message asking twice), are unchanged.

The timed-out call's own text says so too (``timeout_text``): the SDK's default
"timed out" reads as "it did not happen, try again". And a resumed model is told
of each recorded call it does not see with what its evidence allows
(``recorded_line``).
"""

from __future__ import annotations

import json
import weakref
from typing import TYPE_CHECKING, Any

from stopline.domain.guidance import OnResume, on_resume
from stopline.domain.model import OperationRecord, args_digest
from stopline.domain.vocab import OpStatus
from stopline.errors import NotFound, UnstableValue
from stopline.integrations._call_ids import unkept_note
from stopline.integrations._replayed import not_kept

if TYPE_CHECKING:
    from agents import FunctionTool
    from agents.tool import ToolErrorFunction

    from stopline.integrations._frameworks import Bound

__all__ = ["Open", "in_doubt_note", "open_calls", "recorded_line", "timeout_text"]


class Open:
    """The calls of one entry of a run that ended without an answer, by (tool, digest)."""

    def __init__(self, bound: Bound) -> None:
        self.bound = bound
        self._keys: dict[tuple[str, str], list[str]] = {}

    async def key_for(self, tool: str, key: str, value: Any) -> str:
        """The key of a call of ``tool`` with the arguments ``value``: that of an open call
        it repeats, else its own (or the earlier entry's, ``Bound.key_for``)."""
        bound = self.bound
        key = bound.key_for(tool, key, [(value,), {}]) or key
        same = self._keys.get((tool, _digest(value)), [])
        if not same or key in same:
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

    def ended(self, tool: str, key: str, value: Any, *, answered: bool) -> None:
        """The call under ``key`` ended: with an answer for the model, or without one."""
        digest = _digest(value)
        same = self._keys.setdefault((tool, digest), [])
        if answered:
            if key in same:
                same.remove(key)
        elif key not in same and digest:
            same.append(key)


# one per entry of a run (a ``Bound``), whichever agent or guardrail makes the call
_OPEN: weakref.WeakKeyDictionary[Bound, Open] = weakref.WeakKeyDictionary()


def open_calls(bound: Bound) -> Open:
    """The open calls of ``bound``'s entry."""
    found = _OPEN.get(bound)
    if found is None:
        found = _OPEN[bound] = Open(bound)
    return found


def _digest(value: Any) -> str:
    """The digest the gate records of a function tool's call; ``""`` when it has none."""
    try:
        return args_digest([[value], {}])
    except UnstableValue:
        return ""


def in_doubt_note(tool: str, op_id: str) -> str:
    """The model's answer for a call that repeats one in doubt: nothing was sent."""
    return (
        f"{tool} was called earlier in this run with the same arguments ({op_id}) and may "
        "have taken effect: its outcome is in doubt until a read-back or a reviewer "
        "settles it. This call was not sent, so that it cannot happen twice. Do not call "
        "it again for the same request; report it as awaiting confirmation."
    )


def timeout_text(tool: FunctionTool) -> ToolErrorFunction | None:
    """The gated tool's ``timeout_error_function``: the caller's own when it has one,
    else the SDK's default text with what a cut call means (it may have happened)."""
    if tool.timeout_seconds is None or tool.timeout_error_function is not None:
        return tool.timeout_error_function
    name, seconds = tool.name, tool.timeout_seconds

    def said(ctx: Any, error: Exception) -> str:
        return (
            f"Tool '{name}' timed out after {seconds:g} seconds and was cut: it may have "
            "taken effect, and its outcome is being verified. Do not retry it as if it "
            "had failed: the same call with the same arguments is answered from this "
            "call's outcome, never sent a second time."
        )

    return said


def recorded_line(op: OperationRecord, key: str) -> str:
    """One recorded call for a resumed model: what following its evidence allows
    (``on_resume``, the rule a receipt's recovery line is derived from, R14)."""
    said = f"- {op.tool} ({key}): {op.status.value}: "
    follows = on_resume(op.status)
    if follows is OnResume.SENT:
        return said + "did not happen; it may be called again"
    if follows is OnResume.BLOCKS:
        return said + "in doubt; do not repeat it, it is under review"
    why = not_kept(op)  # none kept, or a read-back's commit: a note, never ``null``
    result = json.dumps(op.result, default=str) if why is None else unkept_note(op.tool, why)
    return said + f"done, do not repeat it; result {result}"
