"""What the Agents SDK's model is told of a call in doubt (ADR 0097).

The SDK's own ``timeout=`` of a function tool cuts the call: stopline records it
``unknown`` (its effect may have happened). The SDK's default text, "timed out",
reads as "it did not happen, try again": ``timeout_text`` says the call may have
taken effect, what the ledger records of it, and that a repeat is answered from its
outcome (``gated_call`` matches a repeat of an open call to its key, ``_open_calls``).
A resumed model is told of each recorded call it does not see with what its evidence allows
(``resume_note``, ``recorded_line``), every status in its receipt's words
(``_replayed.said_of``: "in doubt, under review" was said of a call
``compensation_failed`` too, whose effect happened and whose correction failed, ADR
0113; "done" of a committed call, and nothing of a correction that ran for a call
that did not happen, ADR 0121). Pydantic AI's history and a LangGraph thread's
earlier runs say it with the same ``said_of``.

Not every error of a gated call is the tool's: ``NOT_GATED`` are stopline's refusals to
gate it at all (no run bound: a gated agent run outside ``sl.run``; a run entered in
another event loop: ``Runner.run_sync`` in a thread; a closed ledger). Nothing was
recorded or sent. The SDK's error text ("An error occurred while running the tool.
Please try again.") would let the SDK run go on as if a tool had failed once, and
invite the retry; they fail the SDK run instead (ADR 0113).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from stopline.domain.guidance import OnResume, on_resume
from stopline.domain.model import OperationRecord
from stopline.domain.vocab import OpStatus
from stopline.errors import LedgerClosed, NoRun, WrongEventLoop
from stopline.integrations._call_ids import unkept_note
from stopline.integrations._frameworks import current
from stopline.integrations._replayed import not_kept, said_of

if TYPE_CHECKING:
    from agents import FunctionTool
    from agents.tool import ToolErrorFunction

    from stopline.runtime.ledger import Ledger

__all__ = ["NOT_GATED", "recorded_line", "resume_note", "timeout_text"]

NOT_GATED = (NoRun, WrongEventLoop, LedgerClosed)


def timeout_text(tool: FunctionTool) -> ToolErrorFunction | None:
    """The gated tool's ``timeout_error_function``: the caller's own when it has one,
    else the SDK's default text with what a cut call means (it may have happened) and
    what the ledger records of it, in its receipt's words (``said_of``: "its outcome is
    being verified" was said of a call with no read-back too, which a person reviews,
    ADR 0121)."""
    if tool.timeout_seconds is None or tool.timeout_error_function is not None:
        return tool.timeout_error_function
    name, seconds = tool.name, tool.timeout_seconds

    async def said(ctx: Any, error: Exception) -> str:
        recorded = await _recorded(f"tool:{getattr(ctx, 'tool_call_id', '')}")
        return (
            f"Tool '{name}' timed out after {seconds:g} seconds and was cut: it may have "
            f"taken effect.{recorded} Do not retry it as if it had failed: the same call "
            "with the same arguments is answered from this call's outcome, never sent a "
            "second time."
        )

    return said


async def _recorded(key: str) -> str:
    """ " The ledger records it ...", what the run's receipt says of the call under ``key``;
    ``""`` when it holds none (a repeat of an open call, recorded under that call's key)."""
    try:
        bound = current()
    except NoRun:
        return ""
    op_id = f"{bound.run.id}/{key}"
    said = said_of((await bound.ledger.receipt(bound.run.id)).lines, op_id)
    return f" The ledger records it {said}." if said else ""


async def resume_note(ledger: Ledger, run_id: str, shown: Collection[str]) -> str | None:
    """What a resumed model is told of the run's recorded calls its input does not show
    (by call id, ``shown``), ``None`` when there are none: each in its receipt's words
    (``said_of``, the one wording of each status), then what following it allows. A
    correction is told with the call it corrects, never as a call of its own: "did not
    happen; it may be called again" of a failed correction read as the call itself not
    done."""
    ops = await ledger.backend.operations(run_id)
    keys = {op.id: op.id.removeprefix(f"{run_id}/") for op in ops}
    told = [
        op
        for op in ops
        if keys[op.id].removeprefix("tool:") not in shown
        and op.status is not OpStatus.PREVENTED
        and op.compensates is None
    ]
    if not told:
        return None
    lines = list((await ledger.receipt(run_id)).lines)
    said = [recorded_line(op, keys[op.id], said_of(lines, op.id)) for op in told]
    return "Recorded before this resume, each call with what its evidence proves:\n" + "\n".join(
        said
    )


def recorded_line(op: OperationRecord, key: str, said: str) -> str:
    """One recorded call for a resumed model: ``said``, what its receipt says of it
    (``said_of``), then what following its evidence allows (``on_resume``, the rule a
    receipt's recovery line is derived from, R14): it may be called again (it provably
    never happened), do not repeat it (in doubt or in review), or do not repeat it and its
    result (it happened: the recorded answer, or a note saying none was kept, never
    ``null``). A committed call was told "done" and a failed one "did not happen" in words
    of their own (ADR 0121): now every status in the receipt's."""
    line = f"- {op.tool} ({key}): {said or op.status.value}"
    follows = on_resume(op.status)
    if follows is OnResume.SENT:
        return line + "; it may be called again"
    if follows is OnResume.BLOCKS:
        return line + "; do not repeat it"
    why = not_kept(op)  # none kept, or a read-back's commit: a note, never ``null``
    result = json.dumps(op.result, default=str) if why is None else unkept_note(op.tool, why)
    return line + f"; do not repeat it; its result: {result}"
