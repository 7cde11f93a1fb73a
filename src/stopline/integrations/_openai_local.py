"""OpenAI Agents SDK: the tools that are no ``FunctionTool`` but run on this machine.

Beside function tools, the SDK runs four kinds of tool in the process itself, each
with its own entry point, and ``gate_agent`` used to hand them on as they were: their
calls had no record and went on after the fence (a cancel ``after_turn`` lets the
turn's tools run). Each is now gated or refused (ADR 0094):

- a ``CustomTool`` (``on_invoke_tool(ctx, text)``) and a ``ShellTool`` or
  ``LocalShellTool`` with a local ``executor(request)``: every call passes the gate
  under ``tool:<call_id>`` (the model's id, as a function tool's), its arguments
  digested as the model sent them (the text, the shell action), so a resume that
  asks again replays what committed (``Bound.key_for``) instead of running it twice.
  The SDK calls these on the event loop (a ``def`` too, unlike a ``def`` function
  tool), and so does the gate: a cancel interrupts an async one (``unknown`` until
  verified). What one raises is recorded (``unknown``), then handed to the SDK, which
  turns it into text for the model as without stopline;
- a ``ComputerTool`` (a ``Computer``'s many actions) and an ``ApplyPatchTool`` (an
  editor's three methods): their calls reach the code without the model's call id,
  so no call could be keyed, matched on resume or told apart from its retry. The
  agent is refused (``InvalidInput`` naming the tool) unless the tool is named in
  ``reads``: then it runs as it is, outside the gate, as the caller declared;
- hosted tools (web and file search, code interpreter, image generation, hosted MCP,
  tool search, a ``ShellTool`` on a hosted environment) run at the provider, inside
  the model's turn: nothing runs here to gate. They are handed on as they are.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
from collections.abc import Callable, Collection
from typing import Any

from agents import ApplyPatchTool, ComputerTool, CustomTool, LocalShellTool, ShellTool
from agents import Tool as AgentsTool

from stopline.errors import InvalidInput
from stopline.integrations._frameworks import ToolSpec, gated_call
from stopline.runtime.context import CallContext
from stopline.runtime.tool import Tool

__all__ = ["gate_local"]

# the call's own work (the SDK's request bound in), handed to the gated tool
_WORK: contextvars.ContextVar[Callable[[], Any] | None] = contextvars.ContextVar(
    "stopline_openai_local_call", default=None
)


def gate_local(tool: AgentsTool, reads: Collection[str], spec: ToolSpec) -> AgentsTool:
    """``tool`` (no ``FunctionTool``) gated with ``spec`` (its read-back, canceller and
    horizon, as a function tool's), handed on (hosted, or named in ``reads``), or
    refused (``InvalidInput``: it runs here and its calls cannot be keyed)."""
    if tool.name in reads:
        return tool
    if isinstance(tool, CustomTool):
        return _custom(tool, spec)
    if isinstance(tool, ShellTool | LocalShellTool) and tool.executor is not None:
        return _shell(tool, spec)
    if isinstance(tool, ComputerTool | ApplyPatchTool):
        raise InvalidInput(
            "tools",
            f"{tool.name!r} ({type(tool).__name__}) runs on this machine, and its calls "
            "reach it without the model's call id: stopline cannot gate them (no record "
            "before dispatch, nothing refused after a cancel). Name it in reads= only "
            "if running it outside the gate is what you mean; else give the agent a "
            "function tool for the effect",
        )
    return tool  # hosted: it runs at the provider, within the model's turn


def _custom(tool: CustomTool, spec: ToolSpec) -> CustomTool:
    stopline_tool = _stopline_tool(tool.name, spec)
    invoke = tool.on_invoke_tool

    async def on_invoke_tool(ctx: Any, text: str) -> Any:
        return await _through_gate(stopline_tool, ctx.tool_call_id, text, lambda: invoke(ctx, text))

    return dataclasses.replace(tool, on_invoke_tool=on_invoke_tool)


def _shell(tool: ShellTool | LocalShellTool, spec: ToolSpec) -> ShellTool | LocalShellTool:
    stopline_tool = _stopline_tool(tool.name, spec)
    executor: Any = tool.executor

    async def gated_executor(request: Any) -> Any:
        action = request.data.action  # ``ShellActionRequest`` or the model's own item
        arguments = (
            action.model_dump(mode="json")
            if hasattr(action, "model_dump")
            else dataclasses.asdict(action)
        )
        call_id = request.data.call_id
        return await _through_gate(stopline_tool, call_id, arguments, lambda: executor(request))

    return dataclasses.replace(tool, executor=gated_executor)


def _stopline_tool(name: str, spec: ToolSpec) -> Tool[Any]:
    """The stopline tool of a gated call (the receipt names it by the tool's name)."""

    async def direct(ctx: CallContext, arguments: Any) -> Any:
        work = _WORK.get()
        assert work is not None, "called outside the gated tool"
        answer = work()
        return await answer if inspect.isawaitable(answer) else answer

    gated = Tool(direct, name=name, description="")
    gated.wants_context = True
    return spec.declare(gated)


async def _through_gate(
    tool: Tool[Any], call_id: str, arguments: Any, work: Callable[[], Any]
) -> Any:
    """``work()`` as one call of ``tool`` through the current run's gate, under
    ``tool:<call_id>`` (or the recorded call it repeats)."""
    token = _WORK.set(work)
    try:
        return await gated_call(tool, arguments, key=f"tool:{call_id}")
    finally:
        _WORK.reset(token)
