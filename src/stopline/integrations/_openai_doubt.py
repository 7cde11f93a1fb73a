"""What the Agents SDK's model is told of a call in doubt (ADR 0097).

The SDK's own ``timeout=`` of a function tool cuts the call: stopline records it
``unknown`` (its effect may have happened). The SDK's default text, "timed out",
reads as "it did not happen, try again": ``timeout_text`` says the call may have
taken effect and that a repeat is answered from its outcome (``gated_call``
matches a repeat of an open call to its key, ``_open_calls``). A resumed model is
told of each recorded call it does not see with what its evidence allows
(``recorded_line``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from stopline.domain.guidance import OnResume, on_resume
from stopline.domain.model import OperationRecord
from stopline.integrations._call_ids import unkept_note
from stopline.integrations._replayed import not_kept

if TYPE_CHECKING:
    from agents import FunctionTool
    from agents.tool import ToolErrorFunction

__all__ = ["recorded_line", "timeout_text"]


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
