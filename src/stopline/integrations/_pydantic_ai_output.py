"""Pydantic AI's output functions, through the gate.

An output function (``output_type=[fn]``, ``ToolOutput(fn)``, ``TextOutput(fn)``)
runs as Pydantic AI's output processing, not through a toolset: the ``Gate``'s
toolset wrapper never saw it, and one that acts (``output_type=[send_refund]``)
acted with nothing recorded. ``Gate.wrap_output_process`` passes each call of one
through the gate as a tool call is: keyed by its tool call (``tool:<id>``) when it
came as one, digested by the arguments the model sent, its answer recorded and, on
resume, replayed when kept (else ``NotReplayable``: an output is no sentence). A
partial output while streaming is not gated (the function runs on the final one),
nor a function named in ``reads=``. One that refuses before acting (``raise
ModelRetry(...) from stopline.Rejected(...)``) is recorded ``not_committed`` and the
model is asked again, as a tool's refusal is (``said_nothing_done``; it was ``unknown``:
a run whose output function refused bad arguments went to verification, ADR 0121).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic_ai.messages import ToolCallPart

from stopline.integrations._frameworks import ToolSpec, as_verifier, gated_call
from stopline.integrations._pydantic_ai_calls import Refused, said_nothing_done
from stopline.integrations._pydantic_ai_mcp import history_key
from stopline.runtime.tool import Tool

__all__ = ["gated_output"]


async def gated_output(
    gate: Any, name: str, call: ToolCallPart | None, output: object, run: Callable[[], Any]
) -> Any:
    """``run()`` (the output function's processing of ``output``) through the gate, as
    the output function ``name`` called by ``call`` (None: the model's text), declared
    by the ``Gate``'s ``verify``, ``cancel`` and ``settles_within`` as its tools are."""

    async def output_function(arguments: object) -> Any:
        return await said_nothing_done(run)

    tool: Tool[Any] = Tool(output_function, name=name, description=f"output function {name}")
    verify, horizon = as_verifier(gate.verify.get(name)), gate.settles_within.get(name)
    ToolSpec(verify=verify, cancel=gate.cancel.get(name), settles_within=horizon).declare(tool)
    key = history_key(call.tool_call_id) if call is not None else None
    arguments = call.args_as_dict() if call is not None else output
    try:
        return await gated_call(tool, arguments, key=key, unkept_as_text=False)
    except Refused as refused:  # recorded not committed: Pydantic AI's own exception
        raise refused.then from refused.then.__cause__
