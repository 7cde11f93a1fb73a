"""Pydantic AI's message history, as the ledger proves it (``AgentSession.history``).

A history Pydantic AI kept (``RunCancelled.all_messages()``, ``capture_run_messages``)
shows a call without a return when the run stopped under it. Pydantic AI answers
such a call itself before the next request (its history repair: "The tool call was
interrupted before a result was produced."), which, for a call that committed,
reads as "it did not happen": the model asks again. ``repair_history`` adds the
recorded result of every call the ledger proves committed.
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
from stopline.errors import NotFound
from stopline.integrations._pydantic_ai_mcp import history_key
from stopline.integrations._replayed import for_model
from stopline.runtime.ledger import Ledger

__all__ = ["repair_history", "unanswered"]


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
    reviewer's commit: ``_replayed.not_kept``), a note saying so, never ``None``."""
    returns: list[ToolReturnPart] = []
    for part in unanswered(messages):
        try:
            op = await ledger.backend.get_operation(f"{run_id}/{history_key(part.tool_call_id)}")
        except NotFound:
            continue
        if on_resume(op.status) is OnResume.REPLAYED:
            returns.append(ToolReturnPart(part.tool_name, for_model(op), part.tool_call_id))
    out = list(messages)
    if not returns:
        return out
    if out and isinstance(out[-1], ModelRequest):
        last = out[-1]
        out[-1] = dataclasses.replace(last, parts=[*last.parts, *returns])
    else:
        out.append(ModelRequest(parts=returns))
    return out
