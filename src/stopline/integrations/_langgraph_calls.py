"""One LangChain tool call through the gate, as a graph runs it (``gated_message``).

Whoever runs the tool, the call is the same operation, in one place: ``ToolNode``'s
own execution (``sl.gate``, its ``awrap_tool_call`` hook) or the tool's own
``ainvoke`` (``sl.tool`` over any ``BaseTool``, ``GatedBaseTool``). The key is
``tool:<tool_call_id>``; the tool's own ``ToolMessage`` is handed back when it ran
(the ledger records its content, and a replay rebuilds the message from it); a
tool that ``ToolNode`` (or the tool's ``handle_tool_error``) turned into an error
message is recorded (``unknown``) and its message returned; ``interrupt()`` is a
pause, recorded ``not_committed`` (LangGraph re-runs the tool on resume).

**What is recorded of a result JSON cannot write (``kept``, ``restored``).** The
ledger keeps a result as JSON or not at all (``rows.dump_result``, ADR 0049): a
``Command`` a tool or an ``sl.node`` returned, or a node's state update holding
messages, was committed with ``result_not_replayable``, so a replay told the model
"result not kept" (and the command's update was lost) or raised ``NotReplayable``.
Such a result is now handed to the gate as LangGraph writes it into its own
checkpoints (``JsonPlusSerializer``, ``dumps_typed``), in a JSON object the ledger
keeps; both the call that ran and a replay read it back with ``loads_typed``, so
they return the same value, as a checkpoint gives it back (a tuple reads back as a
list: a ``Command``'s default ``goto=()`` as ``[]``, which LangGraph reads alike)
(ADR 0097). What LangGraph's serializer cannot write and read back stays as it
was: not kept, and said so. A result of the kept object's own shape is kept so too,
and comes back as itself; a kept result this process cannot read back is a replay
that cannot give it (``NotReplayable``), never a decode error (ADR 0101).

**A call an earlier run of the thread recorded** (``_langgraph_thread.answer``, ADR
0107), or repeats under a new id one it left in doubt (ADR 0112), is answered from
that record before this run's gate is asked: replayed when it happened, told to the
model what its record proves and what settles it when it is still in doubt after a
read-back (nothing sent), sent in this run when it provably did not happen.

**A ``ParentCommand`` a gated call raises** (a graph it ran handed a command to a
graph above) is how the call ends, not a pause: recorded ``committed`` with its
command (``_Handed``), raised again by the call and by its replay (ADR 0101).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from langchain_core.messages import ToolCall, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langchain_core.utils.pydantic import TypeBaseModel
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.config import get_config
from langgraph.errors import GraphBubbleUp, ParentCommand
from langgraph.prebuilt.tool_node import msg_content_output
from langgraph.types import Command
from pydantic import PrivateAttr

from stopline.domain import jsontext
from stopline.domain.guidance import OnResume, on_resume
from stopline.domain.model import OperationRecord
from stopline.errors import NotReplayable, OperationInDoubt
from stopline.integrations import _langgraph_thread as thread
from stopline.integrations._call_ids import unkept_note
from stopline.integrations._frameworks import (
    ToolSpec,
    Work,
    current,
    detached_tool,
    gated_call,
    stopline_tool,
)
from stopline.integrations._langchain_tools import fits, refusing, runs_in_thread
from stopline.integrations._open_calls import in_doubt_note
from stopline.integrations._replayed import not_kept
from stopline.runtime.context import CallContext
from stopline.runtime.tool import Rejected

__all__ = [
    "GatedBaseTool",
    "bubbled",
    "gated_message",
    "keeping",
    "kept",
    "op_id_of",
    "pausing",
    "replayed",
    "restored",
    "update_of",
]

Execute = Callable[[], Awaitable[Any]]
OnPause = Callable[[str], None]  # told the key of a gated call that called interrupt()


class _Interrupted(Rejected):
    """``interrupt()`` in a gated tool: recorded as not committed, then re-raised."""

    def __init__(self, bubble: GraphBubbleUp) -> None:
        super().__init__(
            "interrupt(): the tool paused for a person; LangGraph re-runs it on resume",
            ref="langgraph:interrupt",
        )
        self.bubble = bubble


class _Handed:
    """The command of a ``ParentCommand`` a gated call raised: the call ran to its end
    and handed it to a graph above (recorded ``committed``; ``restored`` raises it)."""

    def __init__(self, raised: ParentCommand) -> None:
        command = raised.args[0]
        with contextlib.suppress(RuntimeError):  # outside a graph: kept as it is
            config = get_config()
            node = (config.get("metadata") or {}).get("langgraph_node")
            ns = (config.get("configurable") or {}).get("checkpoint_ns")
            if node and command.graph == ns:
                # for the task running the call: named by its node, which LangGraph
                # takes alike, so a replay in another task of it (a call id reused)
                # routes that task, not one whose namespace is gone
                command = dataclasses.replace(command, graph=node)
        self.command = command


# the JSON object a result is kept in when JSON cannot write it: LangGraph's own bytes;
# with ``raised``, the command of a ``ParentCommand`` (``_Handed``)
_KEPT = thread.KEPT
_SHAPES = (frozenset({_KEPT, "data", "shows"}), frozenset({_KEPT, "data", "shows", "raised"}))
_SERDE = JsonPlusSerializer()  # what a checkpointer writes with, by default


def _is_kept(value: Any) -> bool:
    """Whether ``value`` has a shape ``kept`` writes. A result of the tool's own with
    that shape is kept so too (``kept``), so such a record is always one of ours."""
    return isinstance(value, dict) and frozenset(value) in _SHAPES


def kept(value: Any) -> Any:
    """``value`` as the gate is to record it: as it is when JSON can write it, else as
    LangGraph's serializer writes it (with its ``repr`` for a reader of the ledger)."""
    handed = isinstance(value, _Handed)
    if not (handed or isinstance(value, Command) or _is_kept(value)):
        try:
            jsontext.compact(value)
            return value
        except (TypeError, ValueError, RecursionError):
            pass
    target = value.command if handed else value
    try:  # read back once: a record only a later replay would find unreadable is none
        kind, data = _SERDE.dumps_typed(target)
        _SERDE.loads_typed((kind, data))
    except Exception:  # not LangGraph's either: recorded as it is (not kept, said so)
        return value
    text = base64.b64encode(data).decode("ascii")
    shape = {_KEPT: kind, "data": text, "shows": repr(target)[:500]}
    return {**shape, "raised": "ParentCommand"} if handed else shape


def restored(value: Any, op_id: str) -> Any:
    """A recorded result as the tool or node returned it (``kept`` undone), or the
    ``ParentCommand`` it raised, raised again. A kept result that cannot be read back
    here (damaged, or written by another version of the serializer) is a replay that
    cannot give the recorded result: ``NotReplayable`` naming ``op_id``."""
    if isinstance(value, _Handed):  # the call that ran, its command not kept
        raise ParentCommand(value.command)
    if not _is_kept(value):
        return value
    try:
        data = base64.b64decode(value["data"], validate=True)
    except (TypeError, ValueError):  # binascii.Error is a ValueError
        raise NotReplayable(op_id, "its kept result is damaged (not base64)") from None
    try:
        got = _SERDE.loads_typed((value[_KEPT], data))
    except Exception as exc:  # damaged bytes, a kind this serializer does not read
        why = f"its kept result cannot be read back ({type(exc).__name__}: {exc})"
        raise NotReplayable(op_id, why) from None
    if "raised" not in value:
        return got
    if not isinstance(got, Command):
        why = f"its kept ParentCommand reads back as a {type(got).__name__}"
        raise NotReplayable(op_id, why)
    raise ParentCommand(got)


def update_of(op: OperationRecord) -> Any:
    """A node's update as ``op`` records it, replayed (``None`` for a call of it that did
    not happen); ``NotReplayable`` when the record of one that happened holds none (not
    kept, or committed by a read-back or a reviewer, which prove the effect and return
    no update): the graph is not handed an empty update for it (ADR 0120)."""
    why = not_kept(op) if on_resume(op.status) is OnResume.REPLAYED else None
    if why is not None:
        raise NotReplayable(op.id, why)
    return op.result


def keeping(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a node's or a tool's body, sync or async) returning what the gate is to
    record (``kept``), a ``ParentCommand`` it raises included (``_Handed``);
    ``restored`` gives its result back."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def kept_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return kept(await fn(*args, **kwargs))
            except ParentCommand as handed:
                return kept(_Handed(handed))

        return kept_async

    @functools.wraps(fn)
    def kept_sync(*args: Any, **kwargs: Any) -> Any:  # in the adapter's worker thread
        try:
            return kept(fn(*args, **kwargs))
        except ParentCommand as handed:
            return kept(_Handed(handed))

    return kept_sync


def pausing(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a node's or a tool's body, sync or async) with ``interrupt()`` made a
    pause: the ``GraphBubbleUp`` it raises leaves as ``_Interrupted``, which the gate
    records as not committed (LangGraph runs the body again from its start on resume,
    under the same key); ``bubbled`` raises the bubble again for LangGraph. A
    ``ParentCommand`` is no pause: it goes on to ``keeping``."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def paused_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except ParentCommand:
                raise
            except GraphBubbleUp as bubble:
                raise _Interrupted(bubble) from None

        return paused_async

    @functools.wraps(fn)
    def paused_sync(*args: Any, **kwargs: Any) -> Any:  # in the adapter's worker thread
        try:
            return fn(*args, **kwargs)
        except ParentCommand:
            raise
        except GraphBubbleUp as bubble:
            raise _Interrupted(bubble) from None

    return paused_sync


@contextlib.contextmanager
def bubbled(key: str | None = None, paused: OnPause | None = None) -> Iterator[None]:
    """A gated call that paused (``_Interrupted``, recorded) leaves as LangGraph's own
    ``GraphBubbleUp``, so the graph stops to wait; ``paused`` is told its ``key``."""
    try:
        yield
    except _Interrupted as interrupted:
        if key is not None and paused is not None:
            paused(key)
        raise interrupted.bubble from None


def replayed(value: Any, op_id: str, tool: str) -> Any:
    """``restored``, for a tool's answer: a kept result that cannot be read back is
    answered as any result not kept is (``unkept_note``)."""
    try:
        return restored(value, op_id)
    except NotReplayable as refused:
        return unkept_note(tool, refused.why)


def op_id_of(run_id: str, key: str | None, name: str) -> str:
    """The operation a gated call's replay names (``RUN/KEY``; the call's name without
    a key: such a call is never replayed by LangGraph, which always has one)."""
    return f"{run_id}/{key if key is not None else name}"


class _Raised(Exception):
    """The tool raised and was made an error message: recorded, then returned."""

    def __init__(self, message: ToolMessage) -> None:
        super().__init__(str(message.content))
        self.message = message


async def gated_message(
    tool: BaseTool,
    call_id: str | None,
    spec: ToolSpec,
    execute: Execute,
    digest: tuple[tuple[Any, ...], dict[str, Any]],
    paused: OnPause,
) -> Any:
    """``execute()`` (which runs ``tool`` for the call ``call_id``) through the gate.

    ``digest`` is what the gate digests (``(args, kwargs)``). A ``def`` tool (any
    tool LangChain runs in an executor thread) runs to its end whoever stops
    waiting (R4)."""
    if not spec.effects:  # a read: nothing to record, no context; it runs as it is
        return await execute()
    ran: list[ToolMessage] = []  # the tool's own message, when it ran in this call

    def start(ctx: CallContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        async def work() -> Any:
            try:
                message = await execute()
            except ParentCommand as handed:  # it ran, and routes a graph above
                return kept(_Handed(handed))
            except GraphBubbleUp as bubble:  # interrupt(): a pause, not a failure
                raise _Interrupted(bubble) from None
            if isinstance(message, ToolMessage) and message.status == "error":
                raise _Raised(message)
            if not isinstance(message, ToolMessage):
                return kept(message)  # a Command: as LangGraph writes it
            ran.append(message)
            return message.content  # what is recorded (and replayed): the content

        return work

    gated_tool = (
        detached_tool(tool.name, spec, start)
        if runs_in_thread(tool)
        else stopline_tool(_direct(start), tool.name, spec)
    )
    key = f"tool:{call_id}" if call_id else None
    args, kwargs = digest
    op_id = op_id_of(current().run.id, key, tool.name)
    try:
        earlier = await thread.answer(gated_tool, key, args, kwargs)  # the thread's record
        if earlier is not None:  # it happened in an earlier run of the thread: not sent
            answer, op_id = thread.for_model(earlier, key), earlier.id
        else:
            with bubbled(key, paused):
                answer = await gated_call(gated_tool, *args, key=key, **kwargs)
    except _Raised as raised:
        return raised.message
    except OperationInDoubt as doubt:  # a repeat of a call in doubt: nothing was sent
        if call_id is None:
            raise
        bound = current()
        mine = doubt.op_id.startswith(f"{bound.run.id}/")
        when = "earlier in this run" if mine else "in an earlier run of this thread"
        note = await in_doubt_note(bound.ledger, tool.name, doubt.op_id, when=when)
        return ToolMessage(content=note, name=tool.name, tool_call_id=call_id, status="error")
    content = replayed(answer, op_id, tool.name)
    if isinstance(content, Command):
        return content  # a Command the tool returned: passed on as it is
    if ran:  # it ran now: its message as the tool made it (artifact, metadata kept)
        return ran[0]
    if call_id is None:
        return content  # not a tool call (``ainvoke`` with the arguments): its content
    # the tool's content, or a result replayed or read back from the ledger (a
    # verifier's ``ReadBack.result``): made message content as ``ToolNode`` does
    as_content: Any = msg_content_output(content)  # list[dict] is content too
    return ToolMessage(content=as_content, name=tool.name, tool_call_id=call_id)


def _direct(start: Callable[[CallContext, tuple[Any, ...], dict[str, Any]], Work]) -> Any:
    async def call(ctx: CallContext, *args: Any, **kwargs: Any) -> Any:
        return await start(ctx, args, kwargs)()

    return call


class GatedBaseTool(BaseTool):
    """Any ``BaseTool`` (a subclass with ``_run``/``_arun``, ``Tool.from_function``, ...)
    whose calls pass the gate: the tool runs as it is (its ``ainvoke``: its own
    validation, injected arguments, error handling, ``response_format``), and the
    model is shown its schema. Arguments are digested as a ``StructuredTool``'s are
    by ``sl.tool``: as keywords."""

    wrapped: BaseTool
    _spec: ToolSpec = PrivateAttr()
    _paused: OnPause = PrivateAttr()

    @classmethod
    def over(cls, tool: BaseTool, spec: ToolSpec, paused: OnPause) -> GatedBaseTool:
        """``tool`` gated with ``spec``; ``paused`` is told a call that paused the graph."""
        gated = cls(
            name=tool.name,
            description=tool.description,
            args_schema=tool.args_schema,
            return_direct=tool.return_direct,
            wrapped=tool,
        )
        gated._spec, gated._paused = spec, paused
        return gated

    @property
    def args(self) -> dict[str, Any]:
        return self.wrapped.args

    @property
    def tool_call_schema(self) -> Any:
        return self.wrapped.tool_call_schema

    def get_input_schema(self, config: RunnableConfig | None = None) -> TypeBaseModel:
        return self.wrapped.get_input_schema(config)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self.name} is gated by stopline: call it with ainvoke")

    async def ainvoke(
        self,
        input: str | dict[str, Any] | ToolCall,
        config: RunnableConfig | None = None,
        **kwargs: Any,
    ) -> Any:
        is_call = isinstance(input, dict) and input.get("type") == "tool_call"
        args = input["args"] if isinstance(input, dict) and is_call else input
        call_id = str(input.get("id") or "") if isinstance(input, dict) and is_call else None
        tool = self.wrapped
        if isinstance(args, dict) and not fits(tool, args):  # refused before it runs
            tool = refusing(tool)  # (its own refusal, never the tool ungated)
            return await tool.ainvoke(input, config, **kwargs)
        digest: tuple[tuple[Any, ...], dict[str, Any]] = (
            ((), dict(args)) if isinstance(args, dict) else ((args,), {})
        )

        async def execute() -> Any:
            return await self.wrapped.ainvoke(input, config, **kwargs)

        return await gated_message(
            self.wrapped, call_id or None, self._spec, execute, digest, self._paused
        )
