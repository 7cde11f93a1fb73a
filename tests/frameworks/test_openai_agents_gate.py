"""OpenAI Agents SDK: every tool of the agent gated, its own cancel and approvals, a
raising tool, resume that never repeats.

The tools are plain ``@function_tool``s in ``Agent(tools=...)``, not wrapped one
by one. The ground truth is a file each side-effecting call appends to
(``FileEffect``). The model is the SDK's own offline ``ScriptedModel``; a model
asked again after a resume issues its call under a new ``call_id``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from agents import Agent, function_tool, set_tracing_disabled
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

import stopline
from stopline import Headline, OpStatus, RunState
from stopline.integrations import openai_agents as sl
from tests.frameworks.effects import FileEffect, until_unknown

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def no_trace_export() -> None:
    """Nothing leaves the machine: the SDK's tracing exporter stays off."""
    set_tracing_disabled(True)


def write_call(call_id: str) -> list[Any]:
    return [function_call("write_note", {"note": "refund 9"}, call_id=call_id)]


def agent_for(
    effect: FileEffect, steps: list[Any], *, sync: bool, approval: bool = False
) -> tuple[Agent[Any], ScriptedModel]:
    """An agent whose one side-effecting tool is a plain ``@function_tool``."""
    if sync:

        @function_tool(needs_approval=approval)
        def write_note(note: str) -> str:
            """Write a note (a plain def: the SDK runs it in a thread)."""
            return effect.write(note)

    else:

        @function_tool(needs_approval=approval)
        async def write_note(note: str) -> str:
            """Write a note."""
            return await effect.awrite(note)

    model = ScriptedModel(steps)
    return Agent(name="support", model=model, tools=[write_note]), model


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

    async def __call__(
        self, ledger: stopline.Ledger, agent: Any, run_input: Any, run_id: str
    ) -> None:
        verify = {"write_note": self.effect.read_back()}
        async with sl.run(ledger, owner="user:1", run_id=run_id, verify=verify) as s:
            self.handle = s
            self.ready.set()
            await s.stream(agent, run_input)


async def resume(
    ledger: stopline.Ledger, agent: Any, run_input: Any, run_id: str, effect: FileEffect
) -> Any:
    await ledger.resume(run_id, by="user:1")
    session = Session(effect)
    await session(ledger, agent, run_input, run_id)
    assert session.s.result is not None
    return session.s.result.final_output


async def test_s01_openai_agents_plain_tool_cancel_before_the_call_then_resume(
    unwatched: stopline.Ledger, ledger_url: str, tmp_path: Path
) -> None:
    """A plain ``@function_tool`` in ``tools=`` is gated: a cancel committed elsewhere
    refuses its call; the resumed model's new call is dispatched once."""
    ledger = unwatched  # a worker that does not watch: its gate is where it learns
    effect = FileEffect(tmp_path / "notes.txt")
    thinking = anyio.Event()

    async def think(call: Any) -> Any:
        await thinking.wait()
        return write_call("c1")

    steps = [ModelStep.respond(think), write_call("c2"), [assistant_message("done")]]
    agent, _ = agent_for(effect, steps, sync=False)
    session = Session(effect)
    async with anyio.create_task_group() as tg:
        tg.start_soon(session, ledger, agent, "refund 9", "oa-g-s01")
        await session.ready.wait()
        async with stopline.open(ledger_url) as elsewhere:
            await elsewhere.cancel("oa-g-s01", by="user:1")
        thinking.set()
    receipt = await ledger.wait_settled("oa-g-s01", timeout=10)
    assert effect.lines() == []
    assert [line.status for line in receipt.lines] == [OpStatus.PREVENTED]
    assert receipt.message == "Canceled before external action."

    assert await resume(ledger, agent, "refund 9", "oa-g-s01", effect) == "done"
    assert effect.lines() == ["refund 9"]


async def test_s02_openai_agents_cancel_during_an_async_tool_then_resume(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """Cancelled before the async tool writes: unknown, read back, not committed. The
    resumed model sees the recorded outcome in its input; its new call writes once."""
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        steps = [write_call("c1"), write_call("c2"), [assistant_message("done")]]
        agent, model = agent_for(effect, steps, sync=False)
        session = Session(effect)
        async with anyio.create_task_group() as tg:
            tg.start_soon(session, ledger, agent, "refund 9", "oa-g-s02")
            await effect.async_reached.wait()
            await session.s.cancel(by="user:1")
        receipt = await ledger.wait_settled("oa-g-s02", timeout=10)
        (op,) = await ledger.backend.operations("oa-g-s02")
        assert op.status is OpStatus.NOT_COMMITTED and effect.lines() == []
        assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION

        assert session.s.result is not None
        state = session.s.result.to_state()
        effect.hold = False
        assert await resume(ledger, agent, state, "oa-g-s02", effect) == "done"
    assert effect.lines() == ["refund 9"]
    assert [o.id for o in await ledger.backend.operations("oa-g-s02")] == [op.id]
    note = str(model.calls[1].input)  # the first model call after the resume
    assert "write_note (tool:c1): not_committed" in note


async def test_s09_openai_agents_cancel_during_a_def_tool_then_resume_writes_once(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The hole: the SDK's state leaves the interrupted turn out, the model asks again
    under a new call id. The new call is matched to the recorded one: one write."""
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        steps = [write_call("c1"), write_call("c2"), [assistant_message("done")]]
        agent, _ = agent_for(effect, steps, sync=True)
        session = Session(effect)
        async with anyio.create_task_group() as tg:
            tg.start_soon(session, ledger, agent, "refund 9", "oa-g-s09")
            await effect.wait_reached()
            await session.s.cancel(by="user:1")
            await until_unknown(ledger, "oa-g-s09/tool:c1")
            effect.release.set()  # ... and it writes after the cancel
        receipt = await ledger.wait_settled("oa-g-s09", timeout=10)
    assert effect.lines() == ["refund 9"]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS

    assert session.s.result is not None
    state = session.s.result.to_state()
    assert await resume(ledger, agent, state, "oa-g-s09", effect) == "done"
    assert effect.lines() == ["refund 9"]  # not twice


async def test_s03_openai_agents_cancel_after_the_tool_then_resume(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The tool wrote; the model is cancelled while it answers: the receipt says so."""
    effect = FileEffect(tmp_path / "notes.txt")
    answering = anyio.Event()

    async def answer(call: Any) -> Any:
        answering.set()
        await anyio.sleep_forever()  # the model never answers: the cancel stops it

    steps = [
        write_call("c1"),
        ModelStep.respond(answer),
        write_call("c2"),
        [assistant_message("done")],
    ]
    agent, _ = agent_for(effect, steps, sync=False)
    session = Session(effect)
    async with anyio.create_task_group() as tg:
        tg.start_soon(session, ledger, agent, "refund 9", "oa-g-s03")
        await answering.wait()
        await session.s.cancel(by="user:1")
    receipt = await ledger.wait_settled("oa-g-s03", timeout=10)
    assert effect.lines() == ["refund 9"]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS

    assert await resume(ledger, agent, "refund 9", "oa-g-s03", effect) == "done"
    assert effect.lines() == ["refund 9"]


async def test_openai_agents_raising_tool_is_not_completed(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The tool raises before it writes; the SDK hands the model its error text. The
    operation is recorded before that: unknown, read back, not committed."""
    effect = FileEffect(tmp_path / "notes.txt")

    @function_tool
    async def write_note(note: str) -> str:
        """Write a note."""
        raise TimeoutError("the notes service did not answer")

    model = ScriptedModel([write_call("c1"), [assistant_message("done")]])
    agent = Agent(name="support", model=model, tools=[write_note])
    await Session(effect)(ledger, agent, "refund 9", "oa-g-raise")
    (op,) = await ledger.backend.operations("oa-g-raise")
    kinds = [e.kind for e in await ledger.backend.events("oa-g-raise") if e.op_id == op.id]
    assert "committed" not in kinds and "lost" in kinds
    settled = await ledger.wait_settled("oa-g-raise", timeout=10)
    assert [line.status for line in settled.lines] == [OpStatus.NOT_COMMITTED]
    assert "An error occurred while running the tool" in str(model.calls[1].input)  # the SDK


async def test_openai_agents_sdk_cancel_is_a_stopline_cancel(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """``RunResultStreaming.cancel()`` called directly (the SDK's own) while the tool
    waits: the run ends ``cancelled`` with a true receipt, not ``completed``."""
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        agent, _ = agent_for(effect, [write_call("c1")], sync=False)
        session = Session(effect)
        async with anyio.create_task_group() as tg:
            tg.start_soon(session, ledger, agent, "refund 9", "oa-g-native")
            await effect.async_reached.wait()
            assert session.s.result is not None
            session.s.result.cancel(mode="immediate")
        receipt = await ledger.wait_settled("oa-g-native", timeout=10)
    assert receipt.run_state is RunState.CANCELLED
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED]
    assert effect.lines() == []


async def test_openai_agents_cancelling_the_task_is_a_stopline_cancel(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The task consuming the stream is cancelled: a stopline cancel, which also stops
    the SDK's own run loop (it goes on beside the task otherwise)."""
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        agent, _ = agent_for(effect, [write_call("c1")], sync=False)
        async with anyio.create_task_group() as tg:
            tg.start_soon(Session(effect), ledger, agent, "refund 9", "oa-g-task")
            await effect.async_reached.wait()
            tg.cancel_scope.cancel()
        receipt = await ledger.wait_settled("oa-g-task", timeout=10)
    assert receipt.run_state is RunState.CANCELLED
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED]
    assert effect.lines() == []


async def test_openai_agents_cancel_after_turn_lets_the_call_finish(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """``s.cancel(mode="after_turn")``: the call in flight finishes and is kept, the
    next turn never starts, the run ends ``cancelled``."""
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        steps = [write_call("c1"), [assistant_message("done")]]
        agent, model = agent_for(effect, steps, sync=False)
        session = Session(effect)
        async with anyio.create_task_group() as tg:
            tg.start_soon(session, ledger, agent, "refund 9", "oa-g-turn")
            await effect.async_reached.wait()
            await session.s.cancel(by="user:1", mode="after_turn")
            effect.async_release.set()
        receipt = await ledger.wait_settled("oa-g-turn", timeout=10)
    assert effect.lines() == ["refund 9"]
    assert receipt.run_state is RunState.CANCELLED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert len(model.calls) == 1  # the model was not asked again


async def test_s05_openai_agents_needs_approval_pauses_the_run_until_approved(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """``needs_approval``: the run is paused with a stopline approval request (never
    "Completed."); approved in stopline and resumed, the call passes the gate once."""
    effect = FileEffect(tmp_path / "notes.txt")
    steps = [write_call("c1"), [assistant_message("done")]]
    agent, _ = agent_for(effect, steps, sync=False, approval=True)
    async with sl.run(ledger, owner="user:1", run_id="oa-g-s05", approver="manager:1") as s:
        first = await s.stream(agent, "refund 9")
    assert first.interruptions
    receipt = await ledger.receipt("oa-g-s05")
    assert receipt.run_state is RunState.PAUSED and receipt.headline is Headline.PAUSED
    (approval,) = await ledger.backend.approvals("oa-g-s05")
    assert approval.scope == "oa-g-s05/tool:c1"
    with pytest.raises(stopline.RunPaused):
        async with sl.run(ledger, owner="user:1", run_id="oa-g-s05"):
            pass

    await ledger.approve(approval.id, by="manager:1")
    await ledger.resume("oa-g-s05", by="user:1")
    async with sl.run(ledger, owner="user:1", run_id="oa-g-s05") as s:
        done = await s.stream(agent, first.to_state())  # the decision comes from the ledger
    assert done.final_output == "done"
    assert effect.lines() == ["refund 9"]
    final = await ledger.receipt("oa-g-s05")
    assert final.headline is Headline.COMPLETED
    with pytest.raises(stopline.RunEnded):
        async with sl.run(ledger, owner="user:1", run_id="oa-g-s05"):
            pass


async def test_s05_openai_agents_denied_in_stopline_is_rejected_in_the_sdk(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The approver denies in stopline: on resume the SDK state rejects the call, and the
    tool never runs."""
    effect = FileEffect(tmp_path / "notes.txt")
    steps = [write_call("c1"), [assistant_message("not refunded")]]
    agent, _ = agent_for(effect, steps, sync=False, approval=True)
    async with sl.run(ledger, owner="user:1", run_id="oa-g-deny", approver="manager:1") as s:
        first = await s.stream(agent, "refund 9")
    (approval,) = await ledger.backend.approvals("oa-g-deny")
    await ledger.deny(approval.id, by="manager:1")
    await ledger.resume("oa-g-deny", by="user:1")
    async with sl.run(ledger, owner="user:1", run_id="oa-g-deny") as s:
        done = await s.stream(agent, first.to_state())
    assert done.final_output == "not refunded"
    assert effect.lines() == []
    assert await ledger.backend.operations("oa-g-deny") == []  # nothing reached the gate
    assert (await ledger.receipt("oa-g-deny")).headline is Headline.COMPLETED


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize(
    "arguments", ['{"note": ', '["refund 9"]', '{"note": 9}'], ids=["cut", "list", "schema"]
)
async def test_arguments_the_sdk_refuses_are_not_committed_and_told_to_the_model(
    ledger: stopline.Ledger, tmp_path: Path, sync: bool, arguments: str
) -> None:
    """The model's arguments are cut short, not an object, or not the tool's schema: the
    SDK refuses them before the function runs. The call was recorded ``unknown`` and
    the receipt said "verifying" for nothing done; it is ``not_committed``, and the
    model is told what the SDK tells it without stopline."""
    effect = FileEffect(tmp_path / "notes.txt")
    steps = [[function_call("write_note", arguments, call_id="c1")], [assistant_message("ok")]]
    agent, model = agent_for(effect, steps, sync=sync)
    session = Session(effect)
    await session(ledger, agent, "refund 9", "oa-g-args")
    op = await ledger.backend.get_operation("oa-g-args/tool:c1")
    assert op.status is OpStatus.NOT_COMMITTED
    assert "Invalid JSON input for tool write_note" in op.evidence[-1].detail
    assert effect.lines() == []  # the function never ran
    receipt = await ledger.wait_settled("oa-g-args", timeout=10)
    assert receipt.headline is Headline.COMPLETED
    told = str(model.last_call.input if model.last_call else "")
    assert "'output': 'An error occurred while running the tool. Please try again.'" in told


def fenced_barrier(ledger: stopline.Ledger, run_id: str) -> anyio.Event:
    """Set once a cancel of ``run_id`` is durable (``ledger.on_cancel``)."""
    fenced = anyio.Event()
    ledger.on_cancel(lambda run_ids: fenced.set() if run_id in run_ids else None)
    return fenced


async def test_s09_openai_agents_sdk_cancel_of_run_streamed_is_a_stopline_cancel(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The user consumes ``s.run_streamed``'s events and presses stop with the SDK's own
    ``result.cancel()`` while a ``def`` tool is in its thread: the fence is committed
    (not only the SDK's record), the loop leaves the run's block quietly, the late write
    is kept in a ``cancelled`` run's receipt, and the gate refuses what comes after."""
    run_id = "oa-g-rs-cancel"
    fenced = fenced_barrier(ledger, run_id)
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        steps = [write_call("c1"), write_call("c2"), [assistant_message("done")]]
        agent, model = agent_for(effect, steps, sync=True)
        verify = {"write_note": effect.read_back()}
        async with sl.run(ledger, owner="user:1", run_id=run_id, verify=verify) as s:
            result = s.run_streamed(agent, "refund 9")

            async def stop_at_the_tool() -> None:
                try:
                    await effect.wait_reached()
                    result.cancel()  # the user's stop button: the SDK's own cancel
                    with anyio.fail_after(10):  # a bound, not a timing: no fence, no end
                        await fenced.wait()  # stopline's fence, before the thread writes
                finally:
                    effect.release.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(stop_at_the_tool)
                async for _ in result.stream_events():
                    pass
            raise AssertionError("unreachable: the SDK's cancel is a stopline cancel")
        receipt = await ledger.wait_settled(run_id, timeout=10)
    assert receipt.run_state is RunState.CANCELLED
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert effect.lines() == ["refund 9"] and len(model.calls) == 1
    with pytest.raises(stopline.RunFenced):  # the fence refuses any later dispatch
        await ledger.dispatch(run_id, ledger.adopt(effect.awrite), "later", key="later")
    assert effect.lines() == ["refund 9"]


async def test_openai_agents_sdk_cancel_of_run_streamed_left_unread_is_a_stopline_cancel(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """``result.cancel()`` and the block left without reading the events: the run does
    not end ``completed`` before the fence is on record; it ends ``cancelled``."""
    run_id = "oa-g-rs-unread"
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        agent, _ = agent_for(effect, [write_call("c1")], sync=False)
        verify = {"write_note": effect.read_back()}
        async with sl.run(ledger, owner="user:1", run_id=run_id, verify=verify) as s:
            result = s.run_streamed(agent, "refund 9")
            await effect.async_reached.wait()  # the SDK's run goes on in its own task
            result.cancel()
        receipt = await ledger.wait_settled(run_id, timeout=10)
    assert receipt.run_state is RunState.CANCELLED
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED]
    assert effect.lines() == []


async def test_s05_openai_agents_needs_approval_through_run_streamed_pauses_the_run(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """``needs_approval`` with the events of ``s.run_streamed`` consumed by the caller:
    the run is paused with a stopline approval request, never "Completed."."""
    effect = FileEffect(tmp_path / "notes.txt")
    steps = [write_call("c1"), [assistant_message("done")]]
    agent, _ = agent_for(effect, steps, sync=False, approval=True)
    async with sl.run(ledger, owner="user:1", run_id="oa-g-rs-s05", approver="manager:1") as s:
        result = s.run_streamed(agent, "refund 9")
        async for _ in result.stream_events():
            pass
    assert len(result.interruptions) == 1
    receipt = await ledger.receipt("oa-g-rs-s05")
    assert receipt.run_state is RunState.PAUSED and receipt.headline is Headline.PAUSED
    (approval,) = await ledger.backend.approvals("oa-g-rs-s05")
    assert approval.scope == "oa-g-rs-s05/tool:c1" and approval.approver == "manager:1"
    with pytest.raises(stopline.RunPaused):
        async with sl.run(ledger, owner="user:1", run_id="oa-g-rs-s05"):
            pass
    assert effect.lines() == []
