"""Pydantic AI: every tool call of an agent is a stopline operation.

    from stopline.integrations import pydantic_ai as sl

    agent = Agent(model, tools=[refund, lookup], toolsets=[MCPToolset(server)])
    async with sl.run(ledger, owner="user:42", run_id="refund-1042", reads={"lookup"}) as s:
        result = await s.run(agent, "refund order 1042")
    receipt = await s.cancel(by="user:42")        # from another task

What Pydantic AI does on its own (``shared/notes/peers.md``): ``RunCancelled``
is raised and async tools are cancelled, but a sync tool goes on in its
executor thread and commits later, and the history shows the call without a
return. Here:

- ``s.run`` adds the ``Gate`` capability to the run: its
  ``get_wrapper_toolset`` wraps the agent's whole assembled toolset (tools
  given as ``tools=``, registered with ``@agent.tool``, toolsets, MCP toolsets
  alike), so each call passes the dispatch gate under ``tool:<tool_call_id>``
  (the model's id). Tools named in ``reads`` skip the gate (no effects).
  ``Agent(..., capabilities=[sl.Gate(...)])`` does the same for an agent run
  outside ``s.run`` (in the ``sl.run`` block);
- a toolset that gates its own calls (``gated``, ``mcp_toolset``, an agent's own
  ``Gate``) is left to it under any wrapper (``_gates``); an agent a tool runs
  (delegation) is gated in the same run when that run is given ``Gate()``:
  Pydantic AI has no hook over it (ADR 0068);
- an MCP toolset's call carries the operation id in ``_meta["io.stopline/key"]``
  (its ``process_tool_call`` hook, installed by the gate) and is verified through
  the server's ``stopline_verify`` when it offers one;
- ``s.run``, ``s.iter``, ``s.run_stream`` and ``s.run_stream_events`` (the agent's
  entry points of the same names; ``agent.run_stream`` called directly on an agent
  without its own ``Gate`` is not seen: Pydantic AI has no hook over it) share one
  path (``_agent_run``): the gate, a
  ``CancellationToken`` (already cancelled when stopline cancelled the run), the
  recorded approval decisions, and the run's end (``Bound.ended``); an agent run
  that failed reloads what the run recorded (``Bound.load``), so a retry in the
  same block repeats nothing (ADR 0108);
- a repeat of a call in doubt (ADR 0097) is not sent: the model is told so
  (``in_doubt_note``), the agent run goes on;
- ``s.cancel`` fences the run first (R1), then cancels the agent run through its
  ``CancellationToken``. Pydantic AI's own cancels (``AgentRun.cancel()``,
  ``RunContext.cancel()``, a token of yours, cancelling the task) commit the
  same stopline cancel: the run ends ``cancelled`` with its receipt;
- a sync tool's call runs to its end in the ledger's task group: the
  operation is ``unknown`` when the run is cancelled, then ``committed`` with
  the late result (R4); an interrupted async tool is ``unknown`` until
  verified (``verify={name: fn}``, ``async fn(ctx)`` reading the destination back
  by ``ctx.key``);
- resume: with the history Pydantic AI kept (``s.cancelled.all_messages()``),
  ``s.history(...)`` adds the recorded result of every call that committed but
  has no return. Without it, the model asked again issues its calls under new
  ids; a call with the same tool and arguments as a recorded one is that
  operation (``Bound.key_for``): its recorded result, never a second effect;
- approvals: a tool with ``requires_approval`` that the model calls ends the
  agent run with ``DeferredToolRequests`` (``s.run``, or ``s.iter`` iterated to
  its end); the stopline run is paused (not completed) with an approval
  request per call. Once ``ledger.approve`` (or
  ``deny``) and ``ledger.resume``, ``s.run(agent, message_history=...)`` passes
  the recorded decisions as ``deferred_tool_results``, and the approved call
  passes the gate only with its approval granted.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from typing import Any

from pydantic_ai import CancellationToken, DeferredToolRequests, DeferredToolResults
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import RunCancelled as AgentRunCancelled
from pydantic_ai.exceptions import UserError
from pydantic_ai.mcp import MCPToolset as NativeMCPToolset
from pydantic_ai.messages import ModelMessage
from pydantic_ai.tools import RunContext
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset

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
from stopline.integrations._pydantic_ai_calls import Refused, said_nothing_done
from stopline.integrations._pydantic_ai_history import repair_history, unanswered
from stopline.integrations._pydantic_ai_mcp import (
    OP_ID,
    MCPToolset,
    history_key,
    key_in_meta,
    known_name,
    mcp_name,
    mcp_toolset,
    mcp_verify,
)
from stopline.integrations._pydantic_ai_output import gated_output
from stopline.integrations._verify import ServerReadBack, server_id, through
from stopline.integrations.mcp import VERIFY_TOOL, policy_from_listing
from stopline.runtime.context import CallContext
from stopline.runtime.ledger import Ledger
from stopline.runtime.tool import CancelFn, Tool, Verifier

__all__ = [
    "AgentSession",
    "Gate",
    "MCPToolset",
    "NoRun",
    "StoplineToolset",
    "gated",
    "history_key",
    "mcp_toolset",
    "run",
]

# the framework's own call, handed from ``call_tool`` to the gated tool beside the
# arguments (they are the operation's digest; the run context is not)
_CALL: contextvars.ContextVar[tuple[RunContext[Any], ToolsetTool[Any]] | None] = (
    contextvars.ContextVar("stopline_pydantic_ai_call", default=None)
)


@dataclasses.dataclass
class StoplineToolset(WrapperToolset[Any]):
    """A toolset whose side-effecting calls pass the stopline gate."""

    reads: Collection[str] = ()
    verify: Mapping[str, Verifier | VerifyByKey] = dataclasses.field(default_factory=dict)
    cancel: Mapping[str, CancelFn] = dataclasses.field(default_factory=dict)
    settles_within: Mapping[str, float] = dataclasses.field(default_factory=dict)
    _tools: dict[tuple[str, bool, int], Tool[Any]] = dataclasses.field(default_factory=dict)

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        """The tools offered to the model: an MCP server's ``stopline_verify`` is
        stopline's read-back, not the model's (as ``mcp_toolset`` leaves it out)."""
        tools = await self.wrapped.get_tools(ctx)
        # by the name the server knows it by: under a prefix or a rename too
        return {name: tool for name, tool in tools.items() if mcp_name(tool) != VERIFY_TOOL}

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        if name in self.reads or _gated_within(tool) or _reads_only(tool):  # no gate record
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        gated_tool = self._tool_for(name, tool)
        key = history_key(ctx.tool_call_id) if ctx.tool_call_id else None
        token = _CALL.set((ctx, tool))
        try:
            return await gated_call(gated_tool, tool_args, key=key)
        except OperationInDoubt as doubt:  # a repeat of a call in doubt: nothing was sent
            return await in_doubt_note(current().ledger, name, doubt.op_id)
        except Refused as refused:  # recorded not committed: Pydantic AI's own exception
            raise refused.then from refused.then.__cause__
        finally:
            _CALL.reset(token)

    def _tool_for(self, name: str, tool: ToolsetTool[Any]) -> Tool[Any]:
        leaf, mcp = _leaf(tool)
        is_async = bool(getattr(leaf, "is_async", True))
        found = self._tools.get((name, is_async, id(mcp)))
        if found is not None:
            return found
        # the receipt names it by its tool name
        verify, horizon = as_verifier(self.verify.get(name)), self.settles_within.get(name)
        spec = ToolSpec(verify=verify, cancel=self.cancel.get(name), settles_within=horizon)
        if is_async:  # a cancel interrupts it: unknown until verified
            read_back = None  # through the server's stopline_verify (one per server)
            if spec.verify is None and mcp is not None:
                read_back = ServerReadBack(
                    mcp_verify, mcp, server_id(known_name(mcp), _transport(mcp)), mcp_name(tool)
                )
            call = self._direct(name, read_back)
            made: Tool[Any] = Tool(call, name=name, description=spec.description)
            made.wants_context = True
            spec.declare(made)
            if read_back is not None:
                made.verify_fn = read_back
        else:  # a def tool: its executor thread finishes whoever waits (R4)
            made = detached_tool(name, spec, self._framework_call(name))
        self._tools[(name, is_async, id(mcp))] = made
        return made

    def _direct(self, name: str, read_back: ServerReadBack | None) -> Any:
        async def call(ctx: CallContext, tool_args: dict[str, Any]) -> Any:
            token = OP_ID.set(ctx.key)
            try:
                with through(read_back, ctx.key):
                    return await self._framework_call(name)(ctx, (tool_args,), {})()
            finally:
                OP_ID.reset(token)

        return call

    def _framework_call(self, name: str) -> Any:
        def start(ctx: CallContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
            call = _CALL.get()
            assert call is not None, "called outside StoplineToolset.call_tool"
            run_ctx, tool = call
            (tool_args,) = args

            # a retry ``from Rejected``, ``ApprovalRequired``, ``CallDeferred``: not run
            return lambda: said_nothing_done(
                lambda: self.wrapped.call_tool(name, tool_args, run_ctx, tool)
            )

        return start


def _reads_only(tool: ToolsetTool[Any]) -> bool:
    """An MCP server's tool that declares no effects in stopline's ``_meta`` (a
    ``readOnlyHint`` alone is untrusted, ADR 0055), read as ``StoplineMCP`` reads a
    listing (``policy_from_listing``);
    ``stopline_verify`` is a read too."""
    leaf, mcp = _leaf(tool)
    if mcp is None:
        return False
    if mcp_name(tool) == VERIFY_TOOL:  # the server's name for it, whatever the model's
        return True
    listed = leaf.tool_def.metadata or {}
    hints = listed.get("annotations") or {}
    return policy_from_listing(listed.get("meta"), hints.get("readOnlyHint")).effects is False


def _gated_within(tool: ToolsetTool[Any]) -> bool:
    """The tool passes a gate of its own: a toolset wrapped by ``gated`` (with its own
    settings) or ``mcp_toolset`` (``StoplineMCP`` gates each call), under any wrappers
    (``.prefixed()``, ``.renamed()``, ``.filtered()`` ...): never two gates for one call."""
    level: Any = tool
    while level is not None:
        if _gates(getattr(level, "source_toolset", None)) or _gates(level.toolset):
            return True
        level = getattr(level, "source_tool", None)
    return False


def _gates(toolset: AbstractToolset[Any] | None) -> bool:
    """``toolset``, or one it wraps, gates every call of its tools itself."""
    while toolset is not None:
        if isinstance(toolset, StoplineToolset | MCPToolset):
            return True
        toolset = toolset.wrapped if isinstance(toolset, WrapperToolset) else None
    return False


def _leaf(tool: ToolsetTool[Any]) -> tuple[ToolsetTool[Any], Any]:
    """The tool as its own toolset made it, and that toolset if it is an MCP server."""
    leaf = tool
    while (inner := getattr(leaf, "source_tool", None)) is not None:
        leaf = inner
    owner: Any = leaf.toolset
    while isinstance(owner, WrapperToolset):
        owner = owner.wrapped
    return leaf, owner if isinstance(owner, NativeMCPToolset) else None


def gated(
    toolset: AbstractToolset[Any],
    *,
    reads: Collection[str] = (),
    verify: Mapping[str, Verifier | VerifyByKey] | None = None,
    cancel: Mapping[str, CancelFn] | None = None,
    settles_within: Mapping[str, float] | None = None,
) -> StoplineToolset:
    """Wrap a toolset: calls of its tools (except ``reads``) pass the gate. ``verify``
    reads a tool's destination back by ``ctx.key``; ``cancel`` asks its provider to cancel the
    call with that key (an async tool's canceller: a cancel of the run asks it);
    ``settles_within`` bounds, in seconds after dispatch, when its effect may still land
    (R13: a read-back's "not found" proves nothing before)."""
    toolset.apply(key_in_meta)
    return StoplineToolset(
        toolset,
        reads=frozenset(reads),
        verify=dict(verify or {}),
        cancel=dict(cancel or {}),
        settles_within=dict(settles_within or {}),
    )


@dataclasses.dataclass
class Gate(AbstractCapability[Any]):
    """The capability that gates every tool of the agent: its whole toolset, per run."""

    reads: Collection[str] = ()
    verify: Mapping[str, Verifier | VerifyByKey] = dataclasses.field(default_factory=dict)
    cancel: Mapping[str, CancelFn] = dataclasses.field(default_factory=dict)
    settles_within: Mapping[str, float] = dataclasses.field(default_factory=dict)

    async def wrap_output_process(
        self, ctx: RunContext[Any], *, output_context: Any, output: Any, handler: Any
    ) -> Any:
        """An output function acts as a tool does: through the gate (``_pydantic_ai_output``)."""
        name = output_context.function_name or "output"
        if not output_context.has_function or ctx.partial_output or name in self.reads:
            return await handler(output)
        run = functools.partial(handler, output)
        return await gated_output(self, name, output_context.tool_call, output, run)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        if _gates(toolset):  # gated already (the agent's own ``Gate``): its settings hold
            return None
        return gated(
            toolset,
            reads=self.reads,
            verify=self.verify,
            cancel=self.cancel,
            settles_within=self.settles_within,
        )


class AgentSession:
    """One stopline run carrying Pydantic AI agent runs."""

    def __init__(self, bound: Bound, gate: Gate) -> None:
        self.bound = bound
        self.gate = gate
        self.id = bound.run.id
        self.cancelled: AgentRunCancelled | None = None  # what Pydantic AI kept, for resume
        self.waiting: DeferredToolRequests | None = None  # approvals the run is paused for
        self._token: CancellationToken | None = None
        bound.interrupt = self._interrupt

    async def run(self, agent: Any, user_prompt: Any = None, **kwargs: Any) -> Any:
        """``agent.run(...)`` under this run, every tool gated (``Gate``).

        A cancel (stopline's or Pydantic AI's own) ends it and the run's block
        quietly; a ``DeferredToolRequests`` output waiting for approvals pauses the run.
        """
        async with self._agent_run(kwargs) as finished:
            result = await agent.run(user_prompt, **kwargs)
            finished(result)
        return result

    @contextlib.asynccontextmanager
    async def iter(self, agent: Any, user_prompt: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        """``agent.iter(...)`` under this run, as ``run``: ``AgentRun.cancel()`` is a
        stopline cancel, and an agent run iterated to a ``DeferredToolRequests`` output
        pauses the run."""
        async with self._agent_run(kwargs) as finished, agent.iter(user_prompt, **kwargs) as ran:
            yield ran
            finished(ran.result)

    @contextlib.asynccontextmanager
    async def run_stream(
        self, agent: Any, user_prompt: Any = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """``agent.run_stream(...)`` under this run, as ``run``; the run's end is read from
        the streamed result once it is complete (a stream left unread ends it as done)."""
        async with (
            self._agent_run(kwargs) as finished,
            agent.run_stream(user_prompt, **kwargs) as streamed,
        ):
            yield streamed
            finished(_settled(streamed))

    @contextlib.asynccontextmanager
    async def run_stream_events(
        self, agent: Any, user_prompt: Any = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """``agent.run_stream_events(...)`` under this run, as ``run``: its events, the run's
        end read from the last (``AgentRunEvents.result``)."""
        async with (
            self._agent_run(kwargs) as finished,
            agent.run_stream_events(user_prompt, **kwargs) as events,
        ):
            yield events
            finished(events.result)

    @contextlib.asynccontextmanager
    async def _agent_run(self, kwargs: dict[str, Any]) -> AsyncIterator[Callable[[Any], None]]:
        """Around Pydantic AI's run, whichever entry point: the ``Gate``, a cancellation
        token (cancelled already when stopline cancelled the run), the recorded approval
        decisions of a resumed history; then the run's end (``Bound.ended``) from what
        Pydantic AI raised or the result handed to ``finished``."""
        token = self._token = kwargs.pop("cancellation_token", None) or CancellationToken()
        if self.bound.run.cancel_requested:
            token.cancel()
        kwargs["cancellation_token"] = token
        kwargs["capabilities"] = [*(kwargs.get("capabilities") or ()), self.gate]
        if "deferred_tool_results" not in kwargs and kwargs.get("message_history"):
            kwargs["deferred_tool_results"] = await self._decided(kwargs["message_history"])
        results: list[Any] = []  # the agent run's result, once it has one
        cancelled: str | None = None
        try:
            async with self.bound.native_cancels():
                yield results.append
        except AgentRunCancelled as exc:
            self.cancelled = exc
            cancelled = f"Pydantic AI run cancelled: {exc}"
        except Exception:  # failed: a retry of it in this run is matched to what it recorded
            await self.bound.load()
            raise
        finally:
            self._token = None
        output = getattr(results[-1], "output", None) if results else None
        calls = output.approvals if isinstance(output, DeferredToolRequests) else []
        if calls:
            self.waiting = output
        keys = [history_key(call.tool_call_id) for call in calls]
        await self.bound.ended(cancelled=cancelled, waiting=keys)

    async def cancel(self, *, by: str, reason: str = "") -> Any:
        """Fence the run, then cancel the agent run. Returns the receipt at the cancel."""
        return await self.bound.cancel(by=by, reason=reason)

    def _interrupt(self) -> None:
        if self._token is not None:
            self._token.cancel()

    async def history(self, messages: Sequence[ModelMessage]) -> list[ModelMessage]:
        """The messages with the recorded result of each committed call that has no return."""
        return await repair_history(self.bound.ledger, self.id, messages)

    async def _decided(self, messages: Sequence[ModelMessage]) -> DeferredToolResults | None:
        """The recorded approval decisions on the calls of ``messages`` left without a return."""
        open_calls = {history_key(p.tool_call_id): p.tool_call_id for p in unanswered(messages)}
        decided = await self.bound.decisions(open_calls)
        if not decided:
            return None
        return DeferredToolResults(approvals={open_calls[k]: ok for k, ok in decided.items()})


@contextlib.asynccontextmanager
async def run(
    ledger: Ledger,
    *,
    owner: str,
    name: str = "pydantic-ai",
    run_id: str | None = None,
    tenant: str = "default",
    policy: Policy = Policy.VERIFY,
    reads: Collection[str] = (),
    verify: Mapping[str, Verifier | VerifyByKey] | None = None,
    cancel: Mapping[str, CancelFn] | None = None,
    settles_within: Mapping[str, float] | None = None,
    approver: str | None = None,
) -> AsyncIterator[AgentSession]:
    """A stopline run whose agent runs (``s.run``) have every tool gated.

    ``reads`` names tools without effects (no gate record); ``verify`` reads a
    tool's destination back by ``ctx.key``; ``cancel`` asks an async tool's provider to
    cancel the call with that key (a cancel of the run asks every call in flight
    that has one); ``settles_within`` bounds when a tool's effect may still land
    (R13); ``approver`` is asked for deferred approvals.
    """
    gate = Gate(
        frozenset(reads), dict(verify or {}), dict(cancel or {}), dict(settles_within or {})
    )
    async with open_run(
        ledger,
        lambda bound: AgentSession(bound, gate),
        name=name,
        owner=owner,
        run_id=run_id,
        tenant=tenant,
        policy=policy,
        approver=approver,
    ) as session:
        yield session


def _settled(streamed: Any) -> Any:
    """A ``StreamedRunResult``'s run result, ``None`` while it is not settled."""
    with contextlib.suppress(UserError):  # still streaming, or its end raised
        return streamed.result
    return None


def _transport(server: Any) -> object:
    """Where an ``MCPToolset`` connects (its client's transport: a URL, a command)."""
    with contextlib.suppress(Exception):  # a toolset without a client of its own
        return server.client.transport
    return None
