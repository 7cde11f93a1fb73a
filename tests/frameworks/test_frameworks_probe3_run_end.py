"""The run's block ends while the Agents SDK's run goes on (ADR 0068).

``s.run_streamed`` runs the agent in the SDK's own task. A block left without
reading its events to the end ended the stopline run ``completed`` with a call
still in flight, and the SDK's run went on unobserved (its next call refused at a
completed run's gate, the receipt saying "Completed." beside a call not sent).
Now an SDK run still going is cancelled as the block ends (a stopline cancel, as
when the task running the agent is cancelled), and one that ended unread ends the
stopline run as its events would have. The model is the SDK's ``ScriptedModel``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from agents import Agent, function_tool, set_tracing_disabled
from agents.testing import ScriptedModel, assistant_message, function_call

import stopline
from stopline import Headline, OpStatus, RunState
from stopline.integrations import openai_agents as sl
from tests.frameworks.effects import FileEffect, until_unknown

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def no_trace_export() -> None:
    set_tracing_disabled(True)


def writer(effect: FileEffect, *, sync: bool, approval: bool = False) -> Any:
    if sync:

        @function_tool(needs_approval=approval)
        def write_note(note: str) -> str:
            """Write a note (a plain def: the SDK runs it in a thread)."""
            return effect.write(note)

        return write_note

    @function_tool(name_override="write_note", needs_approval=approval)
    async def write_note_async(note: str) -> str:
        """Write a note."""
        return await effect.awrite(note)

    return write_note_async


def two_writes() -> ScriptedModel:
    return ScriptedModel(
        [
            [function_call("write_note", {"note": "refund 9"}, call_id="c1")],
            [function_call("write_note", {"note": "refund 10"}, call_id="c2")],
            [assistant_message("done")],
        ]
    )


async def test_block_left_with_a_def_tool_in_its_thread_cancels_the_sdk_run(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The events not read, the block left while the first call is in its thread: the run
    is cancelled (not completed), the late write is kept, the next call is never made."""
    run_id = "oa-end-def"
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        model = two_writes()
        agent = Agent(name="support", model=model, tools=[writer(effect, sync=True)])
        async with sl.run(ledger, owner="user:1", run_id=run_id) as s:
            s.run_streamed(agent, "refund 9 and 10")
            await effect.wait_reached()
        assert (await ledger.backend.get_run(run_id)).state is not RunState.COMPLETED
        await until_unknown(ledger, f"{run_id}/tool:c1")
        effect.release.set()
        receipt = await ledger.wait_settled(run_id, timeout=10)
    assert receipt.run_state is RunState.CANCELLED
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert [(line.op_id, line.status) for line in receipt.lines] == [
        (f"{run_id}/tool:c1", OpStatus.COMMITTED)
    ]
    assert effect.lines() == ["refund 9"] and len(model.calls) == 1


async def test_block_left_with_an_async_tool_in_flight_reads_it_back(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The same with an async tool: interrupted by the cancel, read back, not committed."""
    run_id = "oa-end-async"
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        agent = Agent(name="support", model=two_writes(), tools=[writer(effect, sync=False)])
        verify = {"write_note": effect.read_back()}
        async with sl.run(ledger, owner="user:1", run_id=run_id, verify=verify) as s:
            s.run_streamed(agent, "refund 9 and 10")
            await effect.async_reached.wait()
        receipt = await ledger.wait_settled(run_id, timeout=10)
    assert receipt.run_state is RunState.CANCELLED
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED]
    assert effect.lines() == []


async def test_block_left_after_an_unread_run_stopped_for_approval_pauses_the_run(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """The SDK's run ended waiting for an approval, its events never read: the stopline
    run is paused with an approval request, as when the events are read, not completed."""
    run_id = "oa-end-approval"
    effect = FileEffect(tmp_path / "notes.txt")
    model = ScriptedModel([[function_call("write_note", {"note": "refund 9"}, call_id="c1")]])
    agent = Agent(name="support", model=model, tools=[writer(effect, sync=False, approval=True)])
    async with sl.run(ledger, owner="user:1", run_id=run_id, approver="manager:1") as s:
        result = s.run_streamed(agent, "refund 9")
        assert result.run_loop_task is not None
        await result.run_loop_task  # the SDK's run, to its end, nobody reading its events
    receipt = await ledger.receipt(run_id)
    assert receipt.run_state is RunState.PAUSED and receipt.headline is Headline.PAUSED
    (approval,) = await ledger.backend.approvals(run_id)
    assert approval.scope == f"{run_id}/tool:c1" and approval.approver == "manager:1"
    assert effect.lines() == []
