"""Pydantic AI: every tool of the agent gated, its own cancels and approvals, resume
that never repeats.

The tools are registered the way the framework's users do (``@agent.tool_plain``),
not wrapped one by one. The ground truth is a file each side-effecting call appends
to (``FileEffect``); every receipt must equal it or say unknown/review, and no
line may be written twice. The model is Pydantic AI's own ``FunctionModel``: a
script asking for ``write_note`` under a new ``tool_call_id`` each turn (a model
asked again after a cancel does not reuse its ids) until it has a return.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

import stopline
from stopline import Headline, OpStatus, RunState
from stopline.integrations import pydantic_ai as sl
from tests.frameworks.effects import FileEffect, until_unknown

pytestmark = pytest.mark.timeout(30)


class Script:
    """Asks for ``write_note`` (id ``t<turn>``) until it has a return, then says so."""

    def __init__(self) -> None:
        self.turns = 0
        self.thinking: anyio.Event | None = None  # when set: wait for it before asking
        self.after_return: anyio.Event | None = None  # ... before answering, once returned
        self.asked = anyio.Event()
        self.first_args: dict[str, Any] | None = None  # the first ask's arguments, if others

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.turns += 1
        done = [
            part.content
            for message in messages
            if isinstance(message, ModelRequest)
            for part in message.parts
            if isinstance(part, ToolReturnPart)
        ]
        if done:
            if self.after_return is not None:
                self.asked.set()
                await self.after_return.wait()
            return ModelResponse(parts=[TextPart(f"done: {done[-1]}")])
        if self.thinking is not None:
            self.asked.set()
            await self.thinking.wait()
        args = self.first_args if self.turns == 1 and self.first_args else {"note": "refund 9"}
        call = ToolCallPart("write_note", args, tool_call_id=f"t{self.turns}")
        return ModelResponse(parts=[call])


def agent_for(effect: FileEffect, script: Script, *, sync: bool, approval: bool = False) -> Any:
    """An agent whose one side-effecting tool is registered with ``@agent.tool_plain``."""
    agent: Agent[None, Any] = Agent(
        FunctionModel(script), output_type=[str, DeferredToolRequests] if approval else str
    )
    if sync:

        @agent.tool_plain(requires_approval=approval)
        def write_note(note: str) -> str:
            """Write a note (a plain def: Pydantic AI runs it in a thread)."""
            return effect.write(note)

    else:

        @agent.tool_plain(requires_approval=approval)
        async def write_note(note: str) -> str:
            """Write a note."""
            return await effect.awrite(note)

    return agent


class Session:
    """An agent run in a stopline run, started in a task group."""

    def __init__(self, effect: FileEffect) -> None:
        self.effect = effect
        self.handle: sl.AgentSession | None = None
        self.ready = anyio.Event()

    @property
    def s(self) -> sl.AgentSession:
        assert self.handle is not None
        return self.handle

    async def __call__(self, ledger: stopline.Ledger, agent: Any, run_id: str) -> None:
        verify = {"write_note": self.effect.read_back()}
        async with sl.run(ledger, owner="user:1", run_id=run_id, verify=verify) as s:
            self.handle = s
            self.ready.set()
            await s.run(agent, "refund order 9")


async def resume_without_history(
    ledger: stopline.Ledger, agent: Any, run_id: str, effect: FileEffect
) -> Any:
    """Resume from the ledger alone: the model is asked again from the prompt."""
    await ledger.resume(run_id, by="user:1")
    verify = {"write_note": effect.read_back()}
    async with sl.run(ledger, owner="user:1", run_id=run_id, verify=verify) as s:
        result = await s.run(agent, "refund order 9")
    return result.output


async def test_s01_pydantic_ai_agent_tool_cancel_before_the_call_then_resume(
    unwatched: stopline.Ledger, ledger_url: str, tmp_path: Path
) -> None:
    """A ``@agent.tool_plain`` is gated: a cancel committed elsewhere refuses its call."""
    ledger = unwatched  # a worker that does not watch: its gate is where it learns
    effect = FileEffect(tmp_path / "notes.txt")
    script = Script()
    script.thinking = anyio.Event()
    agent = agent_for(effect, script, sync=False)
    session = Session(effect)
    async with anyio.create_task_group() as tg:
        tg.start_soon(session, ledger, agent, "pai-g-s01")
        await script.asked.wait()
        async with stopline.open(ledger_url) as elsewhere:  # the gate is where it learns
            await elsewhere.cancel("pai-g-s01", by="user:1")
        script.thinking.set()
    receipt = await ledger.wait_settled("pai-g-s01", timeout=10)
    assert effect.lines() == []
    assert [line.status for line in receipt.lines] == [OpStatus.PREVENTED]
    assert receipt.message == "Canceled before external action."

    script.thinking = None
    assert await resume_without_history(ledger, agent, "pai-g-s01", effect) == (
        "done: wrote refund 9"
    )
    assert effect.lines() == ["refund 9"]  # the prevented call, dispatched once on resume
    final = await ledger.receipt("pai-g-s01")
    assert [line.status for line in final.lines] == [OpStatus.COMMITTED]


async def test_s02_pydantic_ai_cancel_during_an_async_agent_tool_then_resume(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """Cancelled while the async tool waits, before it writes: unknown, read back, not
    committed; the resumed model's new call is matched to it and writes once."""
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        script = Script()
        agent = agent_for(effect, script, sync=False)
        session = Session(effect)
        async with anyio.create_task_group() as tg:
            tg.start_soon(session, ledger, agent, "pai-g-s02")
            await effect.async_reached.wait()
            await session.s.cancel(by="user:1")
        receipt = await ledger.wait_settled("pai-g-s02", timeout=10)
        assert effect.lines() == []
        (op,) = await ledger.backend.operations("pai-g-s02")
        assert op.status is OpStatus.NOT_COMMITTED  # unknown at the cancel, then read back
        kinds = [e.kind for e in await ledger.backend.events("pai-g-s02") if e.op_id == op.id]
        assert kinds.index("lost") < kinds.index("verified_not_committed")
        assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION

        effect.hold = False
        assert await resume_without_history(ledger, agent, "pai-g-s02", effect) == (
            "done: wrote refund 9"
        )
    assert effect.lines() == ["refund 9"]
    assert [op.id for op in await ledger.backend.operations("pai-g-s02")] == [op.id]


async def test_s09_pydantic_ai_cancel_during_a_def_agent_tool_then_resume(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The plain-def tool writes after the cancel: kept as committed; resume replays it."""
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        script = Script()
        agent = agent_for(effect, script, sync=True)
        session = Session(effect)
        async with anyio.create_task_group() as tg:
            tg.start_soon(session, ledger, agent, "pai-g-s09")
            await effect.wait_reached()
            await session.s.cancel(by="user:1")
            await until_unknown(ledger, "pai-g-s09/tool:t1")
            effect.release.set()  # ... and it writes after the cancel
        receipt = await ledger.wait_settled("pai-g-s09", timeout=10)
    assert effect.lines() == ["refund 9"]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS

    assert await resume_without_history(ledger, agent, "pai-g-s09", effect) == (
        "done: wrote refund 9"
    )
    assert effect.lines() == ["refund 9"]  # the new call got the recorded result


async def test_s03_pydantic_ai_cancel_after_the_agent_tool_then_resume(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The tool wrote; the model is cancelled while it answers: the receipt says so."""
    effect = FileEffect(tmp_path / "notes.txt")
    script = Script()
    script.after_return = anyio.Event()
    agent = agent_for(effect, script, sync=False)
    session = Session(effect)
    async with anyio.create_task_group() as tg:
        tg.start_soon(session, ledger, agent, "pai-g-s03")
        await script.asked.wait()
        await session.s.cancel(by="user:1")
    receipt = await ledger.wait_settled("pai-g-s03", timeout=10)
    assert effect.lines() == ["refund 9"]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.message == "Stopped. 1 action had already completed and was kept."

    script.after_return = None
    assert await resume_without_history(ledger, agent, "pai-g-s03", effect) == (
        "done: wrote refund 9"
    )
    assert effect.lines() == ["refund 9"]


async def test_pydantic_ai_agent_run_cancel_is_a_stopline_cancel(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """``AgentRun.cancel()`` (Pydantic AI's own) while the tool waits: the run ends
    ``cancelled`` with a true receipt, not ``failed``."""
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        agent = agent_for(effect, Script(), sync=False)
        verify = {"write_note": effect.read_back()}
        async with sl.run(ledger, owner="user:1", run_id="pai-g-native", verify=verify) as s:
            async with anyio.create_task_group() as tg, s.iter(agent, "refund 9") as agent_run:

                async def cancel_at_the_tool() -> None:
                    await effect.async_reached.wait()
                    agent_run.cancel()

                tg.start_soon(cancel_at_the_tool)
                async for _ in agent_run:
                    pass
            raise AssertionError("unreachable: the agent run was cancelled")
    receipt = await ledger.wait_settled("pai-g-native", timeout=10)
    assert receipt.run_state is RunState.CANCELLED
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED]
    assert effect.lines() == []


async def test_pydantic_ai_cancelling_the_task_is_a_stopline_cancel(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The task running the agent is cancelled (a timeout, a server shutting down)."""
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        agent = agent_for(effect, Script(), sync=False)
        session = Session(effect)
        async with anyio.create_task_group() as tg:
            tg.start_soon(session, ledger, agent, "pai-g-task")
            await effect.async_reached.wait()
            tg.cancel_scope.cancel()
    receipt = await ledger.wait_settled("pai-g-task", timeout=10)
    assert receipt.run_state is RunState.CANCELLED
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED]
    assert effect.lines() == []


async def test_s05_pydantic_ai_approval_pauses_the_run_until_approved(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """``requires_approval``: the run is paused (never "Completed.") with a stopline
    approval request; approved and resumed, the call passes the gate once."""
    effect = FileEffect(tmp_path / "notes.txt")
    agent = agent_for(effect, Script(), sync=False, approval=True)
    async with sl.run(ledger, owner="user:1", run_id="pai-g-s05", approver="manager:1") as s:
        first = await s.run(agent, "refund 9")
    assert isinstance(first.output, DeferredToolRequests)
    receipt = await ledger.receipt("pai-g-s05")
    assert receipt.run_state is RunState.PAUSED and receipt.headline is Headline.PAUSED
    (approval,) = await ledger.backend.approvals("pai-g-s05")
    assert approval.scope == "pai-g-s05/tool:t1" and approval.approver == "manager:1"
    with pytest.raises(stopline.RunPaused):  # re-entering before anyone decided
        async with sl.run(ledger, owner="user:1", run_id="pai-g-s05"):
            pass
    assert effect.lines() == []

    await ledger.approve(approval.id, by="manager:1")
    await ledger.resume("pai-g-s05", by="user:1")
    async with sl.run(ledger, owner="user:1", run_id="pai-g-s05") as s:
        done = await s.run(agent, message_history=first.all_messages())
    assert done.output == "done: wrote refund 9"
    assert effect.lines() == ["refund 9"]
    final = await ledger.receipt("pai-g-s05")
    assert final.headline is Headline.COMPLETED
    assert [line.status for line in final.lines] == [OpStatus.COMMITTED]
    with pytest.raises(stopline.RunEnded):  # nothing would run in it: said, not ignored
        async with sl.run(ledger, owner="user:1", run_id="pai-g-s05"):
            pass


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_arguments_the_tool_refuses_pass_no_gate(
    ledger: stopline.Ledger, tmp_path: Path, sync: bool
) -> None:
    """The model's arguments do not fit the tool: Pydantic AI refuses them and tells the
    model before its toolset is called, so no operation is recorded for them (the
    LangGraph and OpenAI Agents hooks had to be taught this; this one holds it)."""
    effect = FileEffect(tmp_path / "notes.txt")
    script = Script()
    script.first_args = {"memo": 9}
    session = Session(effect)
    await session(ledger, agent_for(effect, script, sync=sync), "pai-g-args")
    assert await ledger.backend.operations("pai-g-args") == []
    assert effect.lines() == []
    assert script.turns == 2  # told of the refusal, the model answered
    assert (await ledger.wait_settled("pai-g-args", timeout=10)).headline is Headline.COMPLETED


async def iterate(s: sl.AgentSession, agent: Any, *args: Any, **kwargs: Any) -> Any:
    """``s.iter(...)`` driven to its end, node by node; the agent run's result."""
    async with s.iter(agent, *args, **kwargs) as agent_run:
        async for _ in agent_run:
            pass
    return agent_run.result


async def test_s05_pydantic_ai_approval_through_iter_pauses_the_run_until_approved(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """``requires_approval`` driven through ``s.iter``: the run is paused (never
    "Completed.") with a stopline approval request; approved and resumed through
    ``s.iter`` with the history, the call passes the gate once."""
    effect = FileEffect(tmp_path / "notes.txt")
    agent = agent_for(effect, Script(), sync=False, approval=True)
    async with sl.run(ledger, owner="user:1", run_id="pai-g-iter", approver="manager:1") as s:
        first = await iterate(s, agent, "refund 9")
    assert isinstance(first.output, DeferredToolRequests)
    receipt = await ledger.receipt("pai-g-iter")
    assert receipt.run_state is RunState.PAUSED and receipt.headline is Headline.PAUSED
    (approval,) = await ledger.backend.approvals("pai-g-iter")
    assert approval.scope == "pai-g-iter/tool:t1" and approval.approver == "manager:1"
    with pytest.raises(stopline.RunPaused):
        async with sl.run(ledger, owner="user:1", run_id="pai-g-iter"):
            pass
    assert effect.lines() == []

    await ledger.approve(approval.id, by="manager:1")
    await ledger.resume("pai-g-iter", by="user:1")
    async with sl.run(ledger, owner="user:1", run_id="pai-g-iter") as s:
        done = await iterate(s, agent, message_history=first.all_messages())
    assert done.output == "done: wrote refund 9"
    assert effect.lines() == ["refund 9"]
    final = await ledger.receipt("pai-g-iter")
    assert final.headline is Headline.COMPLETED
    assert [line.status for line in final.lines] == [OpStatus.COMMITTED]


async def test_pydantic_ai_iter_after_the_fence_does_not_run(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """``s.iter`` in a run stopline has cancelled already (``at_boundary``: the block
    goes on to its next boundary) does not start the agent run, as ``s.run`` does not:
    the model is never asked, nothing is dispatched, the block ends quietly."""
    effect = FileEffect(tmp_path / "notes.txt")
    script = Script()
    agent = agent_for(effect, script, sync=False)
    policy = stopline.Policy.AT_BOUNDARY
    async with sl.run(ledger, owner="user:1", run_id="pai-g-fenced", policy=policy) as s:
        await s.cancel(by="user:1")
        assert s.bound.run.cancel_requested
        await iterate(s, agent, "refund 9")
        raise AssertionError("unreachable: the run was cancelled")
    assert script.turns == 0 and s.cancelled is not None
    receipt = await ledger.wait_settled("pai-g-fenced", timeout=10)
    assert receipt.run_state is RunState.CANCELLED and not receipt.lines
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert await ledger.backend.operations("pai-g-fenced") == []
    with pytest.raises(stopline.RunFenced):  # the fence refuses any later dispatch
        await ledger.dispatch("pai-g-fenced", ledger.adopt(effect.awrite), "later", key="later")
    assert effect.lines() == []
