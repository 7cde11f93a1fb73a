"""OpenAI Agents SDK: the agents an agent leads to, gated like it.

A run reaches other agents two ways, and their tools pass the gate as the
first agent's do (``gate_agent`` hands each of them to ``again``, its gated copy):

- **a handoff**: an ``Agent`` in ``handoffs=``, or a ``Handoff`` object
  (``agents.handoff(agent, ...)``). A ``Handoff`` names its target only when it
  runs (``on_invoke_handoff`` returns the agent), so its copy gates whatever
  agent that returns (``handoff_to``); the target it was built for
  (``_agent_ref``) is the gated copy too.
- **an agent used as a tool** (``Agent.as_tool``): the SDK's tool runs the agent
  it was made from (``_agent_instance``, the ``self`` of its invoker). Its copy
  runs the gated copy of that agent (``agent_tool_over``), so the child's tools
  pass the gate of the same run: after a cancel's fence, the child dispatches
  nothing more (R1), whatever the cancel's mode.

A hook may give an agent a handoff at run time (``agent.handoffs = [...]`` in
``RunHooks.on_agent_start`` or ``AgentHooks.on_start``): the SDK reads the list every
turn (``get_handoffs``, a function of its own, after the hooks). The gated copy's
``get_all_tools``, the turn's read of its tools just before, gates what the list
gained (``gate_handoffs``), ADR 0108.

Both rest on the SDK's private structure (0.24); when it is not there,
``agent_tool_over`` refuses with ``InvalidInput`` naming the tool rather than let
the child's tools run ungated.
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from collections.abc import Callable
from typing import Any

from agents import Agent, FunctionTool
from agents.handoffs import Handoff

from stopline.errors import InvalidInput

__all__ = ["agent_of", "agent_tool_over", "gate_handoffs", "handoff_to"]

Again = Callable[[Agent[Any]], Agent[Any]]


def handoff_to(handoff: Handoff[Any, Any], again: Again) -> Handoff[Any, Any]:
    """A copy of ``handoff`` that leads to the gated copy of the agent it returns."""
    invoke = handoff.on_invoke_handoff

    async def on_invoke_handoff(ctx: Any, input_json: str | None = None) -> Any:
        target = await invoke(ctx, input_json)  # type: ignore[arg-type]  # the SDK's own call
        return again(target) if isinstance(target, Agent) else target

    copy = dataclasses.replace(handoff, on_invoke_handoff=on_invoke_handoff)
    built_for = handoff._agent_ref() if handoff._agent_ref is not None else None
    if isinstance(built_for, Agent):  # kept alive by ``again``'s copies
        object.__setattr__(copy, "_agent_ref", weakref.ref(again(built_for)))
    return copy


def gate_handoffs(agent: Agent[Any], again: Again, made: dict[int, object]) -> None:
    """Give ``agent`` (a gated copy) a list of its handoffs in which each entry not gated
    yet (not in ``made``, by id) is its gated copy; the list as it was when all are."""
    if all(id(h) in made for h in agent.handoffs):
        return
    led = [
        h if id(h) in made else again(h) if isinstance(h, Agent) else handoff_to(h, again)
        for h in agent.handoffs
    ]
    made.update((id(h), h) for h in led)  # held: an id is never another handoff's
    agent.handoffs = led


def agent_of(tool: FunctionTool) -> Agent[Any] | None:
    """The agent a tool made by ``Agent.as_tool`` runs, else ``None``."""
    agent = getattr(tool, "_agent_instance", None)
    return agent if getattr(tool, "_is_agent_tool", False) and isinstance(agent, Agent) else None


def agent_tool_over(tool: FunctionTool, agent: Agent[Any], child: Agent[Any]) -> FunctionTool:
    """A copy of ``tool`` (``agent.as_tool(...)``) that runs ``child`` instead of ``agent``,
    with every other setting of the tool as it was."""
    invoke: Any = tool.on_invoke_tool  # the SDK's failure-handling invoker (private)
    impl = getattr(invoke, "_invoke_tool_impl", None)
    code = getattr(impl, "__code__", None)
    closure = getattr(impl, "__closure__", None)
    cells = list(closure or ())
    if code is None or "self" not in code.co_freevars or len(cells) != len(code.co_freevars):
        raise _unreachable(tool)
    at = code.co_freevars.index("self")
    if cells[at].cell_contents is not agent:
        raise _unreachable(tool)
    cells[at] = types.CellType(child)
    assert isinstance(impl, types.FunctionType)
    runs_child = types.FunctionType(
        code, impl.__globals__, impl.__name__, impl.__defaults__, tuple(cells)
    )
    runs_child.__kwdefaults__ = impl.__kwdefaults__
    runs_child.__qualname__ = impl.__qualname__
    handled = getattr(invoke, "_on_handled_error", None)  # the SDK's error reporting
    if handled is None:
        raise _unreachable(tool)
    copy = dataclasses.replace(tool, on_invoke_tool=type(invoke)(runs_child, handled))
    for name in ("_is_agent_tool", "_agent_tool_default_identity"):
        if hasattr(tool, name):
            setattr(copy, name, getattr(tool, name))
    copy._agent_instance = child
    return copy


def _unreachable(tool: FunctionTool) -> InvalidInput:
    return InvalidInput(
        "tools",
        f"the agent tool {tool.name!r} (Agent.as_tool) cannot be gated inside with this "
        "version of the Agents SDK (its invoker is not the one it builds): its agent's "
        "tools would run ungated, so the agent is refused",
    )
