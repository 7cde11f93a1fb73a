"""OpenAI Agents SDK: every tool call of an agent is a stopline operation.

    from stopline.integrations import openai_agents as sl

    agent = Agent(name="support", tools=[refund, lookup], mcp_servers=[server])
    async with sl.run(ledger, owner="user:42", run_id="refund-1042", reads={"lookup"}) as s:
        await s.stream(agent, "refund order 1042")
    receipt = await s.cancel(by="user:42")        # from another task

What the SDK does on its own (``shared/notes/peers.md``):
``RunResultStreaming.cancel(mode="immediate")`` keeps no record of the tool
calls in flight, while a sync tool goes on in its thread and commits; its saved
``RunState`` leaves the interrupted turn out, so a resumed model asks again
under new call ids. Here:

- ``s.run_streamed``/``s.stream`` run a gated copy of the agent (and of the
  agents it hands off to): each ``FunctionTool`` (``gated``) and each tool of its
  ``mcp_servers`` (``Agent.get_mcp_tools``) passes the dispatch gate under
  ``tool:<call_id>``; ``reads`` skip it. Each call of a ``CustomTool`` and of a
  local ``ShellTool``/``LocalShellTool`` passes it too; an agent with a ``ComputerTool`` or an
  ``ApplyPatchTool`` is refused unless ``reads`` names it (``_openai_local``, ADR 0094).
  An MCP call carries the operation id in
  ``_meta["io.stopline/key"]`` (the server's ``tool_meta_resolver``) and is
  verified through the server's ``stopline_verify`` when it offers one;
- a tool that raises is recorded before the SDK turns the error into text for
  the model: the operation is ``unknown`` (then verified or reviewed), never
  ``completed``; one cut by its own ``timeout=`` too, and the model is told it may
  have happened. The same call asked for again in the same entry takes the key of
  the one in doubt (``_openai_doubt``, ADR 0097): never a blind second dispatch;
- an SDK run that failed, retried in the same ``sl.run`` block, is resumed as a new
  entry would be (``Bound.load``, ADR 0108); a tool or a handoff a hook assigns at
  run time is gated too (``get_all_tools``; ``gate_handoffs``: whenever it is read);
- ``s.cancel(by=..., mode=...)`` fences the run first (R1), then calls the SDK's
  ``RunResultStreaming.cancel(mode)``. ``after_turn`` lets the calls in flight
  finish (the run's policy becomes ``at_boundary``); ``immediate`` keeps the
  run's policy. ``s.result.cancel(...)``, the SDK's own (called by anyone, on
  either entry point), commits the same stopline cancel at once, and so does
  cancelling the task;
- a sync tool's call runs to its end in the ledger's task group: it is
  ``unknown`` when the run is cancelled, then ``committed`` with the late result
  (R4); an interrupted async tool is ``unknown`` until verified;
- resume: from ``s.result.to_state()`` (or its JSON: ``RunState.from_json``, the
  state's agents gated, ``_openai_nested.gated_state``) or from the prompt alone, in a new
  ``sl.run`` with the same run id (after ``ledger.resume``). The model input
  gets the recorded outcome of each gated call it does not show
  (``RunConfig.call_model_input_filter``), and a call issued again with the
  same tool and arguments is the recorded operation (``Bound.key_for``): its
  recorded result, never a second effect;
- approvals: a tool with ``needs_approval`` stops the SDK run with
  interruptions; the stopline run is paused (not completed) with an approval
  request per call, whether ``s.stream`` or you consume the events of
  ``s.run_streamed`` (at their end: ``Bound.ended``, both entry points). After
  ``ledger.approve``/``deny`` and ``ledger.resume``, ``s.stream(agent, state)``
  applies the recorded decisions to the state (``state.approve``/``reject``)
  and the approved call passes the gate only with its approval granted.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import AsyncIterator, Collection, Mapping
from typing import Any, Literal

from agents import Agent, FunctionTool, RunConfig, Runner, RunState
from agents import Tool as AgentsTool
from agents import tool as agents_tool
from agents.exceptions import ModelBehaviorError
from agents.result import RunResultStreaming
from agents.run_config import CallModelData, ModelInputData
from agents.stream_events import StreamEvent
from agents.tool_context import ToolContext

from stopline.domain.lifecycle import Action
from stopline.domain.vocab import Policy
from stopline.errors import OperationInDoubt
from stopline.integrations._frameworks import (
    Bound,
    NoRun,
    ToolSpec,
    VerifyByKey,
    Work,
    as_verifier,
    current,
    detached_tool,
    gated_call,
    open_run,
)
from stopline.integrations._open_calls import in_doubt_note
from stopline.integrations._openai_arguments import json_value, refusing_arguments
from stopline.integrations._openai_doubt import NOT_GATED, resume_note, timeout_text
from stopline.integrations._openai_local import gate_local
from stopline.integrations._openai_mcp import (
    GATED,
    OP_ID,
    invoker_body,
    key_in_meta,
    mcp_server_of,
    mcp_tool_name,
    mcp_tools,
    mcp_verify,
    offered,
    reads_only,
)
from stopline.integrations._openai_nested import (
    agent_of,
    agent_tool_over,
    gate_handoffs,
    gated_state,
    refuse_ungated,
)
from stopline.integrations._verify import ServerReadBack, server_id, through
from stopline.runtime.context import CallContext
from stopline.runtime.ledger import Ledger
from stopline.runtime.tool import CancelFn, Rejected, Tool, Verifier

__all__ = ["AgentSession", "NoRun", "gate_agent", "gated", "mcp_tools", "run"]

# the SDK's tool context and the model's argument text, handed to the gated tool
# beside the parsed arguments (those are the operation's digest: ``json_value``)
_CALL: contextvars.ContextVar[tuple[ToolContext[Any], str] | None] = contextvars.ContextVar(
    "stopline_openai_agents_call", default=None
)


def gated(
    tool: FunctionTool,
    *,
    verify: Verifier | VerifyByKey | None = None,
    cancel: CancelFn | None = None,
    settles_within: float | None = None,
) -> FunctionTool:
    """The same function tool, its calls passing the stopline gate under ``tool:<call_id>``.

    The gated call is the tool's own body, before the SDK's error handling: an
    exception is recorded (``unknown``), then handed to the tool's
    ``failure_error_function`` as the SDK would.
    """
    invoke = tool.on_invoke_tool
    if getattr(invoke, GATED, False):
        return tool
    body = invoker_body(tool)  # errors still raised
    server = mcp_server_of(body)
    if server is not None:
        key_in_meta(server)
    # the receipt names it by its tool name; ``settles_within``: its R13 horizon
    spec = ToolSpec(verify=as_verifier(verify), cancel=cancel, settles_within=settles_within)

    def start(ctx: CallContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        call = _CALL.get()
        assert call is not None, "called outside the gated tool"
        tool_ctx, text = call  # the SDK parses the model's text itself, as without stopline
        return lambda: refusing_arguments(body(tool_ctx, text))

    if _runs_in_thread(tool):  # the SDK runs it in a thread: let it finish, keep its answer
        stopline_tool = detached_tool(tool.name, spec, start)
    else:  # a cancel interrupts it: unknown until verified
        read_back = None  # the server's stopline_verify: one declaration per server's tool
        if spec.verify is None and server is not None:
            read_back = ServerReadBack(
                mcp_verify,
                server,
                server_id(server.name, getattr(server, "params", None)),
                mcp_tool_name(body),
            )

        async def direct(ctx: CallContext, arguments: Any) -> Any:
            token = OP_ID.set(ctx.key)
            try:
                with through(read_back, ctx.key):
                    return await start(ctx, (arguments,), {})()
            finally:
                OP_ID.reset(token)

        stopline_tool = Tool(direct, name=tool.name, description=spec.description)
        stopline_tool.wants_context = True
        spec.declare(stopline_tool)
        if read_back is not None:
            stopline_tool.verify_fn = read_back

    async def on_invoke_tool(ctx: ToolContext[Any], arguments: str) -> Any:
        token = _CALL.set((ctx, arguments))
        try:  # compared as parsed: the same JSON spelled another way is the same call
            key = f"tool:{ctx.tool_call_id}"
            return await gated_call(stopline_tool, json_value(arguments), key=key)
        except OperationInDoubt as doubt:  # a repeat of a call in doubt: nothing was sent
            return await in_doubt_note(current().ledger, tool.name, doubt.op_id)
        except Exception as exc:
            if body is invoke or isinstance(exc, NOT_GATED):  # no gate: the SDK run fails
                raise
            # recorded; now what the SDK does with a tool's error (text for the model)
            cause = exc.__cause__ if isinstance(exc, Rejected) else None
            text = await agents_tool.maybe_invoke_function_tool_failure_error_function(
                function_tool=gated_tool,
                context=ctx,
                error=cause if isinstance(cause, ModelBehaviorError) else exc,
            )
            if text is None:
                raise
            return text
        finally:
            _CALL.reset(token)

    setattr(on_invoke_tool, GATED, True)
    gated_tool = dataclasses.replace(
        tool, on_invoke_tool=on_invoke_tool, timeout_error_function=timeout_text(tool)
    )
    return gated_tool


def gate_agent(
    agent: Agent[Any],
    *,
    reads: Collection[str] = (),
    verify: Mapping[str, Verifier | VerifyByKey] | None = None,
    cancel: Mapping[str, CancelFn] | None = None,
    settles_within: Mapping[str, float] | None = None,
    _seen: dict[int, Agent[Any]] | None = None,
) -> Agent[Any]:
    """A copy of ``agent`` whose tools pass the gate: its function tools and the tools
    of its ``mcp_servers``, except ``reads`` (a server's ``readOnlyHint`` alone is
    untrusted, ADR 0055);
    and so of every agent it leads to: its handoffs (``Agent`` or ``Handoff``) and the
    agents it uses as tools (``_openai_nested``)."""
    seen = {} if _seen is None else _seen
    if id(agent) in seen or any(agent is c for c in seen.values()):  # a copy is gated
        return seen.get(id(agent), agent)
    verify, cancel, horizons = dict(verify or {}), dict(cancel or {}), dict(settles_within or {})

    def again(other: Agent[Any]) -> Agent[Any]:
        return gate_agent(
            other, reads=reads, verify=verify, cancel=cancel, settles_within=horizons, _seen=seen
        )

    def gate(tool: AgentsTool, *, mcp: bool = False) -> AgentsTool:
        if not isinstance(tool, FunctionTool):  # custom, shell, computer, hosted tools
            name = tool.name
            spec = ToolSpec(
                verify=as_verifier(verify.get(name)),
                cancel=cancel.get(name),
                settles_within=horizons.get(name),
            )
            return gate_local(tool, reads, spec)
        child = agent_of(tool)
        if child is not None:  # an agent used as a tool: not an operation, its tools are
            return agent_tool_over(tool, child, again(child))
        if tool.name in reads or (mcp and reads_only(tool)):
            return tool
        name = tool.name
        return gated(
            tool,
            verify=verify.get(name),
            cancel=cancel.get(name),
            settles_within=horizons.get(name),
        )

    copy = seen[id(agent)] = agent.clone()  # first: an agent may lead back to itself
    copy.tools = [gate(t) for t in agent.tools]
    gate_handoffs(copy, again)  # gated whenever read: a hook, instructions may assign them
    listed, every = copy.get_mcp_tools, copy.get_all_tools
    made = {id(t): t for t in copy.tools}  # held: an id is never another tool's

    async def get_mcp_tools(run_context: Any) -> list[AgentsTool]:
        return [gate(t, mcp=True) for t in offered(await listed(run_context))]

    async def get_all_tools(run_context: Any) -> list[AgentsTool]:
        """Every turn's tools; one a hook gave the agent at run time (``agent.tools =``,
        which the SDK reads after its hooks) passes the gate too (ADR 0108)."""
        return [t if id(t) in made else gate(t, mcp=True) for t in await every(run_context)]

    object.__setattr__(copy, "get_mcp_tools", get_mcp_tools)
    object.__setattr__(copy, "get_all_tools", get_all_tools)
    return copy


def _runs_in_thread(tool: FunctionTool) -> bool:
    """The SDK marks the invoker of a ``def`` tool (it runs it with ``asyncio.to_thread``)."""
    marker = getattr(agents_tool, "_SYNC_FUNCTION_TOOL_MARKER", "")  # private in 0.24
    return bool(marker) and bool(getattr(tool.on_invoke_tool, marker, False))


class AgentSession:
    """One stopline run carrying Agents SDK runs."""

    def __init__(
        self,
        bound: Bound,
        reads: Collection[str],
        verify: Mapping[str, Verifier | VerifyByKey],
        cancel: Mapping[str, CancelFn] | None = None,
        settles_within: Mapping[str, float] | None = None,
    ) -> None:
        self.bound = bound
        self.id = bound.run.id
        self.reads = reads
        self.verify = verify
        self.cancels = dict(cancel or {})
        self.settles_within = dict(settles_within or {})
        self.result: RunResultStreaming | None = None
        bound.interrupt = self._interrupt
        self._mode: Literal["immediate", "after_turn"] = "immediate"
        self._cancelled = False  # the SDK's cancel was called, by stopline or anyone
        self._ended_for: RunResultStreaming | None = None  # the result whose end is applied
        bound.leaving = self._left

    def run_streamed(self, agent: Any, run_input: Any, **kwargs: Any) -> RunResultStreaming:
        """``Runner.run_streamed`` of the gated agent under this run.

        Its ``cancel`` (the SDK's own, called by anyone) is a stopline cancel: the fence
        is committed at once. Consuming its ``stream_events()`` to the end ends the run
        as ``s.stream`` does (``_ended``): cancelled, it raises ``RunFenced`` (the run's
        block ends quietly); stopped for approvals, the run is paused. A ``RunState``
        as ``run_input`` is first ``state = await s.apply_decisions(state)`` (the recorded
        decisions; one restored from JSON is refused without it: ADR 0121).
        """
        refuse_ungated(run_input)  # the SDK runs a state's agents: none ungated
        gated_agent = self._gate(agent)
        config = kwargs.pop("run_config", None) or RunConfig()
        user_filter = config.call_model_input_filter
        config = dataclasses.replace(
            config, call_model_input_filter=functools.partial(self._recorded_outcomes, user_filter)
        )
        self._cancelled = False
        result = self.result = Runner.run_streamed(
            gated_agent, run_input, run_config=config, **kwargs
        )
        sdk_cancel, sdk_events = result.cancel, result.stream_events

        def cancel(mode: Literal["immediate", "after_turn"] = "immediate") -> None:
            """The SDK's own cancel, called by anyone: a stopline cancel too."""
            self._take_mode(mode)
            self._cancelled = True
            sdk_cancel(mode=mode)
            self.bound.native_cancel_soon(f"Agents SDK run cancelled ({mode})")

        async def stream_events() -> AsyncIterator[StreamEvent]:
            """The SDK's events; at their end, the run's end (``_ended``). A run that
            failed: a retry of it in this run is matched to what it recorded (``load``)."""
            try:
                async with self.bound.native_cancels():
                    async for event in sdk_events():
                        yield event
            except Exception:
                await self.bound.load()
                raise
            await self._ended(result)

        object.__setattr__(result, "cancel", cancel)
        object.__setattr__(result, "stream_events", stream_events)
        if self.bound.run.cancel_requested:
            sdk_cancel(mode="immediate")
        return result

    def _gate(self, agent: Agent[Any]) -> Agent[Any]:
        return gate_agent(
            agent,
            reads=self.reads,
            verify=self.verify,
            cancel=self.cancels,
            settles_within=self.settles_within,
        )

    async def stream(self, agent: Any, run_input: Any, **kwargs: Any) -> RunResultStreaming:
        """Run to the end, consuming the events; a cancel ends the run's block quietly.

        An SDK run stopped for approvals pauses the stopline run (``s.result`` keeps
        the interruptions; resume with ``s.stream(agent, s.result.to_state())``).
        """
        if isinstance(run_input, RunState):
            run_input = await self.apply_decisions(run_input)
        result = self.run_streamed(agent, run_input, **kwargs)
        async for _ in result.stream_events():
            pass
        return result

    async def _ended(self, result: RunResultStreaming) -> None:
        """The SDK's run ended (its events consumed): cancelled, or waiting for approvals."""
        self._ended_for = result
        cancelled = self._cancelled or self.bound.run.cancel_requested
        await self.bound.ended(
            cancelled=f"Agents SDK run cancelled ({self._mode})" if cancelled else None,
            waiting=[f"tool:{item.call_id}" for item in result.interruptions],
        )

    async def _left(self) -> None:
        """The run's block ends (ADR 0068). An SDK run still going (``run_streamed`` not
        read to its end) is cancelled: nobody follows it any more, as when the task
        running the agent is cancelled; one that ended unread ends the stopline run as
        its events would have (paused when it waits for approvals)."""
        result = self.result
        if result is None or self._ended_for is result or self._cancelled:
            return
        if not result.is_complete:  # the fence first (R1), then the SDK's cancel
            self._take_mode("immediate")
            await self.bound.native_cancel("the run's block ended with its Agents SDK run going on")
            return
        waiting = [f"tool:{item.call_id}" for item in result.interruptions]
        await self.bound.ended(waiting=waiting)

    async def apply_decisions(self, state: Any) -> Any:
        """Approve or reject each interruption of ``state`` as recorded in the ledger; the
        state to run: ``state``, or one restored from JSON, restored again against the gated
        agents (``gated_state``: the SDK runs the state's agents, ADR 0121)."""
        state = await gated_state(state, self._gate)
        items = {f"tool:{item.call_id}": item for item in state.get_interruptions()}
        for key, granted in (await self.bound.decisions(items)).items():
            (state.approve if granted else state.reject)(items[key])
        return state

    async def cancel(
        self, *, by: str, reason: str = "", mode: Literal["immediate", "after_turn"] = "immediate"
    ) -> Any:
        """Fence the run, then ``RunResultStreaming.cancel(mode)``; the receipt at the cancel.

        ``after_turn`` lets the calls in flight finish: the run's policy becomes
        ``at_boundary`` before the fence, so stopline does not interrupt them either.
        """
        # R11 first: a refused cancel changes nothing, the run's policy included
        await self.bound.ledger.authorize(by, Action.CANCEL, self.id)
        self._take_mode(mode)
        return await self.bound.cancel(by=by, reason=reason)

    def _take_mode(self, mode: Literal["immediate", "after_turn"]) -> None:
        """The first cancel's mode (a second one returns the receipt, R7): ``after_turn``
        makes the run's policy ``at_boundary``, before the fence."""
        if self.bound.run.cancel_requested or self._cancelled:
            return
        self._mode = mode
        if mode == "after_turn":
            self.bound.run.policy = Policy.AT_BOUNDARY

    def _interrupt(self) -> None:
        if self.result is not None:
            self.result.cancel(mode=self._mode)

    async def _recorded_outcomes(
        self, user_filter: Any, data: CallModelData[Any]
    ) -> ModelInputData:
        """The model input, with what this run recorded of calls the input does not show."""
        model_data = data.model_data
        if user_filter is not None:
            filtered = user_filter(data)
            model_data = await filtered if hasattr(filtered, "__await__") else filtered
        if not self.bound.resumed:
            return model_data  # nothing recorded before this entry
        shown = {
            str(item.get("call_id"))
            for item in model_data.input
            if isinstance(item, dict) and item.get("call_id")
        }
        note = await resume_note(self.bound.ledger, self.id, shown)
        if note is None:
            return model_data
        message: Any = {"role": "developer", "content": note}
        return dataclasses.replace(model_data, input=[*model_data.input, message])


@contextlib.asynccontextmanager
async def run(
    ledger: Ledger,
    *,
    owner: str,
    name: str = "openai-agents",
    run_id: str | None = None,
    tenant: str = "default",
    policy: Policy = Policy.VERIFY,
    reads: Collection[str] = (),
    verify: Mapping[str, Verifier | VerifyByKey] | None = None,
    cancel: Mapping[str, CancelFn] | None = None,
    settles_within: Mapping[str, float] | None = None,
    approver: str | None = None,
) -> AsyncIterator[AgentSession]:
    """A stopline run whose agent runs (``s.stream``) have every tool gated.

    ``reads`` names tools without effects (no gate record); ``verify`` reads a
    tool's destination back by ``ctx.key``; ``cancel`` asks an async tool's provider to
    cancel the call with that key (a cancel of the run asks every call in flight
    that has one); ``settles_within`` bounds when a tool's effect may still land
    (R13: a read-back's "not found" proves nothing before); ``approver`` is asked
    for ``needs_approval``.
    """
    async with open_run(
        ledger,
        lambda bound: AgentSession(
            bound, frozenset(reads), dict(verify or {}), cancel, settles_within
        ),
        name=name,
        owner=owner,
        run_id=run_id,
        tenant=tenant,
        policy=policy,
        approver=approver,
    ) as session:
        yield session
