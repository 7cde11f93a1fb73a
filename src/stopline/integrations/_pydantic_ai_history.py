"""Pydantic AI's message history, as the ledger proves it (``AgentSession.history``).

A history Pydantic AI kept (``RunCancelled.all_messages()``, ``capture_run_messages``)
shows a call without a return when the run stopped under it. Pydantic AI answers
such a call itself before the next request (its history repair: "The tool call was
interrupted before a result was produced."), which, for a call that committed,
reads as "it did not happen": the model asks again. ``repair_history`` adds the
recorded result of every call the ledger proves committed, and, for a call in doubt
(its status blocks a resume, ``on_resume``), a return saying what its record proves
(``doubt_note``: in flight, unknown or in review, it may have happened; a correction
that failed, it happened and was not undone, ADR 0113), in the words of the run's
receipt (``_replayed.said_of``, shared with the other adapters), the one source of what
each status proves: the common case is an agent run that failed and is retried in its
block (ADR 0108), whose interrupted request holds the other calls' returns. A call
of a response that ends the history is left open: Pydantic AI runs it again under
its own id and the gate answers it from its record (ADR 0097). Each return goes
where Pydantic AI's own repair puts it, in the request after the call's response.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    ToolCallPart,
    ToolReturnPart,
)

from stopline.domain.guidance import OnResume, on_resume
from stopline.domain.model import OperationRecord
from stopline.errors import NotFound
from stopline.integrations._pydantic_ai_mcp import history_key
from stopline.integrations._replayed import for_model, said_of
from stopline.runtime.ledger import Ledger

__all__ = ["doubt_note", "repair_history", "unanswered"]


def unanswered(messages: Sequence[ModelMessage]) -> list[ToolCallPart]:
    """The tool calls of ``messages`` that have no return (nor retry prompt)."""
    answered = {
        part.tool_call_id
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart | RetryPromptPart)
    }
    return [
        part
        for message in messages
        if isinstance(message, ModelResponse)
        for part in message.parts
        if isinstance(part, ToolCallPart) and part.tool_call_id not in answered
    ]


async def repair_history(
    ledger: Ledger, run_id: str, messages: Sequence[ModelMessage]
) -> list[ModelMessage]:
    """Add a return for every tool call that committed (per the ledger) but has none:
    its recorded result, or, when the ledger holds none (not kept, or a read-back's or a
    reviewer's commit: ``_replayed.not_kept``), a note saying so, never ``None``; and for
    every call in doubt outside the response that ends the history, ``doubt_note``."""
    out = list(messages)
    returns: dict[int, list[ToolReturnPart]] = {}  # by the index of the call's response
    doubts: list[tuple[int, ToolCallPart, OperationRecord]] = []
    for at, part in _unanswered_at(out):
        try:
            op = await ledger.backend.get_operation(f"{run_id}/{history_key(part.tool_call_id)}")
        except NotFound:
            continue
        follows = on_resume(op.status)
        if follows is OnResume.REPLAYED:
            returns.setdefault(at, []).append(
                ToolReturnPart(part.tool_name, for_model(op), part.tool_call_id)
            )
        elif follows is OnResume.BLOCKS:
            doubts.append((at, part, op))
    # the response ending the history is Pydantic AI's to run again, unless a return is
    # added after it (then it no longer ends the history)
    frontier = len(out) - 1 if out and isinstance(out[-1], ModelResponse) else None
    noted = [(at, part, op) for at, part, op in doubts if at != frontier or at in returns]
    # what each status proves, as the run's receipt says it (read once, when needed)
    lines = list((await ledger.receipt(run_id)).lines) if noted else []
    for at, part, op in noted:
        note = doubt_note(part.tool_name, op.id, said_of(lines, op.id))
        returns.setdefault(at, []).append(
            ToolReturnPart(part.tool_name, note, part.tool_call_id, outcome="interrupted")
        )
    for at in sorted(returns, reverse=True):  # from the end: the indices stay true
        after = at + 1
        if after < len(out) and isinstance(request := out[after], ModelRequest):
            out[after] = dataclasses.replace(request, parts=[*request.parts, *returns[at]])
        else:
            out.insert(after, ModelRequest(parts=returns[at]))
    return out


def _unanswered_at(messages: Sequence[ModelMessage]) -> list[tuple[int, ToolCallPart]]:
    """``unanswered``, each call with the index of the response that asked for it."""
    left = {id(part) for part in unanswered(messages)}
    return [
        (at, part)
        for at, message in enumerate(messages)
        if isinstance(message, ModelResponse)
        for part in message.parts
        if isinstance(part, ToolCallPart) and id(part) in left
    ]


def doubt_note(tool: str, op_id: str, said: str) -> str:
    """The return of a call in doubt, or in review, that has none: what the ledger records
    of it, ``said`` in its receipt's words (``said_of``: its status first)."""
    return (
        f"This call of {tool} ({op_id}) got no answer here. The run's ledger records it "
        f"{said}. Do not call it again for the same request (the same call is not sent a "
        "second time); report it as the ledger records it."
    )
