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

User code may give an agent a handoff at run time (``agent.handoffs = [...]`` or
``.append``) anywhere: a hook (``on_agent_start``, ``on_llm_end``, ...), a dynamic
``instructions`` or ``prompt`` function, a tool. The SDK reads the list where it
likes (``get_handoffs``, a function of its own: after the turn's tools and
instructions, and before the tools when it resumes an interrupted turn). So the
gated copy's ``handoffs`` is an attribute that gates what it holds whenever it is
read (``gate_handoffs``): whoever reads it, at any point of a turn, gets gated
entries only. Gating at one read of the SDK's (the turn's ``get_all_tools``, ADR
0108) let a handoff given between that read and ``get_handoffs`` (by a dynamic
``instructions``) lead to an ungated agent (ADR 0113).

A run resumed from a ``RunState`` runs the state's agents, not the one handed to
``Runner.run_streamed``: its current agent (and its starting agent, the root of the
identities its approvals are bound to). A state restored with ``RunState.from_json(agent,
...)`` (the SDK's way to keep an interrupted run across processes) holds the user's own
agents: the approved call and every later one ran ungated, with no record (ADR 0121).
``gated_state`` restores it against their gated copies (``s.stream`` and
``s.apply_decisions`` do; ``s.run_streamed``, which cannot wait for that, refuses such
a state).

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

from agents import Agent, FunctionTool, RunState
from agents.handoffs import Handoff

from stopline.errors import InvalidInput

__all__ = [
    "agent_of",
    "agent_tool_over",
    "gate_handoffs",
    "gated_state",
    "handoff_to",
    "is_gated",
    "refuse_ungated",
    "ungated_state",
]

Again = Callable[[Agent[Any]], Agent[Any]]
GATED_COPY = "__stopline_gated_copy__"  # a class attribute of every gated copy's kind


def is_gated(agent: Agent[Any]) -> bool:
    """``agent`` is a gated copy (made by ``gate_agent``), or a clone of one."""
    return bool(getattr(type(agent), GATED_COPY, False))


def ungated_state(state: RunState[Any, Any]) -> bool:
    """The SDK would resume ``state`` with an agent nobody gated (restored from JSON)."""
    agent = getattr(state, "_current_agent", None)  # the SDK's (private in 0.24)
    return isinstance(agent, Agent) and not is_gated(agent)


def refuse_ungated(run_input: Any) -> None:
    """``s.run_streamed`` (it cannot wait for ``gated_state``) refuses a ``RunState``
    whose agents nobody gated, naming the ways that restore it gated."""
    if isinstance(run_input, RunState) and ungated_state(run_input):
        raise InvalidInput(
            "run_input",
            "a RunState whose agents nobody gated (restored with RunState.from_json): the "
            "SDK would run them, their tools ungated. Use s.stream(agent, state), or state "
            "= await s.apply_decisions(state) before s.run_streamed(agent, state)",
        )


async def gated_state(state: RunState[Any, Any], again: Again) -> RunState[Any, Any]:
    """``state``, or, when it holds agents nobody gated, the same state as the SDK restores
    it against their gated copies (``again``): its own round trip (``to_json``,
    ``from_json``) finds every agent and tool by name in the gated graph, the calls
    waiting for approval and an agent tool's nested state among them. Its context is
    kept as it is (the object, not a copy)."""
    # the SDK's own fields (private in 0.24): the agent the run began with, its context
    root = getattr(state, "_starting_agent", None) or getattr(state, "_current_agent", None)
    if not isinstance(root, Agent) or not ungated_state(state):
        return state
    context = getattr(state, "_context", None)  # the user's object, approvals and all
    return await RunState.from_json(again(root), state.to_json(), context_override=context)


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


def gate_handoffs(copy: Agent[Any], again: Again) -> None:
    """Make ``copy`` (a gated copy) an agent whose ``handoffs``, read by anyone, hold
    only gated entries: each one not gated yet becomes its gated copy (an ``Agent``) or
    a copy leading to one (a ``Handoff``, ``handoff_to``) as it is read. Its clones
    (``agent.clone()``, the SDK's execution copies) are of the same kind."""
    made: dict[int, object] = {}  # the entries gated, by id (held: an id is never reused)

    def read(agent: Agent[Any]) -> list[Any]:
        listed: list[Any] = agent.__dict__.get("handoffs", [])
        if all(id(h) in made for h in listed):
            return listed  # the same list: an in-place ``append`` is seen at the next read
        led = [
            h if id(h) in made else again(h) if isinstance(h, Agent) else handoff_to(h, again)
            for h in listed
        ]
        made.update((id(h), h) for h in led)
        agent.__dict__["handoffs"] = led
        return led

    def assign(agent: Agent[Any], value: list[Any]) -> None:
        agent.__dict__["handoffs"] = value  # gated when read

    base = type(copy)
    kind = type(
        base.__name__,
        (base,),
        {
            "handoffs": property(read, assign),
            GATED_COPY: True,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
        },
    )
    handoffs = copy.__dict__.get("handoffs", [])
    copy.__class__ = kind  # a data descriptor: it is read and set in place of the field
    copy.handoffs = list(handoffs)  # its own list: the user's agent keeps its own
    read(copy)  # the agents it leads to now, gated before the run starts


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
