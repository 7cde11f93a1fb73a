"""Probe 14 of the Agents SDK adapter (ADR 0121): what a resumed model is told of each
recorded call, in the receipt's words.

The resume note worded a call in doubt or in review, and one corrected, as the run's
receipt does (``said_of``, ADR 0113), but a committed call in words of its own ("done,
do not repeat it"), and a call that did not happen without the correction recorded for
it. Every line now starts with what the receipt says of the call (its status and their
words, its correction's line, what follows), then what that allows.

Real agents with the SDK's ``ScriptedModel``, real SQLite ledgers.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import anyio
import pytest
from agents import Agent, RunState, function_tool, set_tracing_disabled
from agents.testing import ScriptedModel, assistant_message, function_call

import stopline
from stopline import Headline, OpStatus
from stopline.integrations import openai_agents as sl
from tests.frameworks.effects import statuses
from tests.truth.helpers import quiesce

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def no_trace_export() -> None:
    set_tracing_disabled(True)


def stopline_tool(
    ledger: stopline.Ledger, name: str, *, refuses: bool = False, correction: str = ""
) -> stopline.Tool[Any]:
    """A registered tool that answers (or refuses: ``not_committed``), corrected by a
    compensator that succeeds (``correction="ok"``) or that the provider refuses
    (``"refused"``)."""

    async def act(ctx: stopline.CallContext, what: str) -> str:
        if refuses:
            raise stopline.Rejected(f"{what} is closed")
        return f"{name} {what}"

    tool = stopline.Tool(act, name=name)
    tool.wants_context = True
    if correction:
        tool.compensation = stopline.Compensation.ALWAYS

        @tool.compensator
        async def _(ctx: stopline.CallContext) -> str:
            if correction == "refused":
                raise stopline.Rejected("the provider refuses the correction")
            return "undone"

    ledger.register_tool(tool)
    return tool


async def test_every_line_of_the_resume_note_is_the_receipts(ledger: stopline.Ledger) -> None:
    """Committed, not committed, corrected, correction failed: each call's line is what the
    receipt says of it, then what follows. Failed on the old code: "committed: done, do not
    repeat it", not the receipt's "committed: completed"."""
    tools = {
        "send": stopline_tool(ledger, "send"),
        "refund": stopline_tool(ledger, "refund", refuses=True),
        "book": stopline_tool(ledger, "book", correction="ok"),
        "charge": stopline_tool(ledger, "charge", correction="refused"),
    }
    again = ScriptedModel([[assistant_message("all reported")]])
    async with sl.run(ledger, owner="user:1", run_id="p14-note") as s:
        for name, tool in tools.items():
            with pytest.raises(stopline.Rejected) if name == "refund" else nullcontext():
                await s.bound.run.call(tool, "1042", key=f"tool:{name[0]}1")
        await ledger.compensate("p14-note/tool:b1", by="user:1")
        await ledger.compensate("p14-note/tool:c1", by="user:1")
        await quiesce(ledger)
        failing = ScriptedModel([ConnectionError("the model's API hung up")])
        with pytest.raises(ConnectionError):  # the SDK run fails: retried as a new entry
            await s.stream(Agent(name="a", model=failing), "what happened?")
        await s.stream(Agent(name="a", model=again), "what happened?")
    (note,) = [
        item["content"]
        for item in again.calls[0].input
        if isinstance(item, dict) and item.get("role") == "developer"
    ]
    told = {line.split(" ")[2]: line for line in note.splitlines()[1:]}
    lines = (await ledger.receipt("p14-note")).lines
    said = {line.op_id: f"{line.status.value}: {line.status_words}" for line in lines}
    words = {line.op_id: line.status_words for line in lines}
    for name in tools:
        key = f"tool:{name[0]}1"
        assert told[f"({key}):"].startswith(f"- {name} ({key}): {said[f'p14-note/{key}']}")
    assert told["(tool:s1):"].endswith('do not repeat it; its result: "send 1042"')
    assert (
        told["(tool:r1):"]
        == "- refund (tool:r1): not_committed: did not happen; it may be called again"
    )
    assert (
        f"its correction p14-note/tool:b1~compensate: {words['p14-note/tool:b1~compensate']}"
        in told["(tool:b1):"]
    )
    assert "; do not repeat it" in told["(tool:c1):"] and "its result" not in told["(tool:c1):"]
    assert set(told) == {"(tool:s1):", "(tool:r1):", "(tool:b1):", "(tool:c1):"}


def approval_agent(done: list[str]) -> tuple[Agent[Any], ScriptedModel]:
    """An agent whose refund needs approval, then notifies."""

    @function_tool(needs_approval=True)
    async def refund(order: str) -> str:
        """Refund an order."""
        done.append(f"refund {order}")
        return f"refunded {order}"

    @function_tool
    async def notify(order: str) -> str:
        """Tell the customer."""
        done.append(f"notify {order}")
        return "told"

    model = ScriptedModel(
        [
            [function_call("refund", {"order": "7"}, call_id="k1")],
            [function_call("notify", {"order": "7"}, call_id="n1")],
            [assistant_message("done")],
        ]
    )
    return Agent(name="billing", model=model, tools=[refund, notify]), model


async def paused_for_approval(ledger: stopline.Ledger, agent: Agent[Any], run_id: str) -> Any:
    """Run ``agent`` to its interruption; approve in stopline and resume the run: the
    SDK state as JSON, as an application keeps it between processes."""
    async with sl.run(ledger, owner="user:1", run_id=run_id, approver="manager:1") as s:
        first = await s.stream(agent, "refund order 7")
    assert first.interruptions
    saved = first.to_state().to_json()
    for approval in await ledger.backend.approvals(run_id):
        await ledger.approve(approval.id, by="manager:1")
    await ledger.resume(run_id, by="user:1")
    return saved


async def test_a_state_restored_from_json_runs_its_calls_through_the_gate(
    ledger: stopline.Ledger,
) -> None:
    """``RunState.from_json(agent, ...)`` holds the user's agent, and the SDK resumes the
    state's agent, not the one given: the approved refund and the next call ran with no
    record (the receipt empty, "Completed."). Now each passes the gate. Failed on the
    old code."""
    done: list[str] = []
    agent, _ = approval_agent(done)
    saved = await paused_for_approval(ledger, agent, "p14-json")
    state = await RunState.from_json(agent, saved)
    async with sl.run(ledger, owner="user:1", run_id="p14-json") as s:
        again = await s.stream(agent, state)
    assert again.final_output == "done"
    assert done == ["refund 7", "notify 7"]
    assert await statuses(ledger, "p14-json") == {
        "tool:k1": OpStatus.COMMITTED,
        "tool:n1": OpStatus.COMMITTED,
    }


async def test_a_state_restored_from_json_cut_by_a_cancel_is_on_record(
    ledger: stopline.Ledger,
) -> None:
    """The run cancelled while the approved refund is in flight (it has acted): the
    receipt says a completed action was kept (read back), and nothing more is sent.
    Failed on the old code: nothing recorded, "Canceled before external action."
    beside a refund made."""
    done: list[str] = []
    go_on, inside = anyio.Event(), anyio.Event()

    @function_tool(needs_approval=True)
    async def refund(order: str) -> str:
        """Refund an order."""
        done.append(f"refund {order}")
        inside.set()
        await go_on.wait()  # the answer is on its way back when the cancel comes
        return f"refunded {order}"

    async def read_back(ctx: stopline.CallContext) -> stopline.ReadBack:
        made = "refund 7" in done
        verdict = stopline.Verdict.COMMITTED if made else stopline.Verdict.NOT_COMMITTED
        return stopline.ReadBack(verdict, "refunds:7", "read back")

    agent, _ = approval_agent(done)
    agent.tools[0] = refund
    saved = await paused_for_approval(ledger, agent, "p14-json-cut")
    state = await RunState.from_json(agent, saved)
    sessions: list[sl.AgentSession] = []

    async def go() -> None:
        verify = {"refund": read_back}
        async with sl.run(ledger, owner="user:1", run_id="p14-json-cut", verify=verify) as s:
            sessions.append(s)
            await s.stream(agent, state)

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        await inside.wait()
        await sessions[0].cancel(by="user:1")
    receipt = await ledger.wait_settled("p14-json-cut", timeout=10)
    assert done == ["refund 7"]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert await statuses(ledger, "p14-json-cut") == {"tool:k1": OpStatus.COMMITTED}


async def test_run_streamed_refuses_a_state_restored_from_json_until_applied(
    ledger: stopline.Ledger,
) -> None:
    """``s.run_streamed`` cannot wait to restore the state against the gated agents: it
    refuses it (``InvalidInput``, nothing run), and runs the state ``s.apply_decisions``
    returns, gated. Failed on the old code: accepted, run ungated."""
    done: list[str] = []
    agent, _ = approval_agent(done)
    saved = await paused_for_approval(ledger, agent, "p14-json-rs")
    state = await RunState.from_json(agent, saved)
    async with sl.run(ledger, owner="user:1", run_id="p14-json-rs") as s:
        with pytest.raises(stopline.InvalidInput, match="apply_decisions"):
            s.run_streamed(agent, state)
        assert done == []
        state = await s.apply_decisions(state)
        result = s.run_streamed(agent, state)
        async for _ in result.stream_events():
            pass
    assert result.final_output == "done" and done == ["refund 7", "notify 7"]
    assert await statuses(ledger, "p14-json-rs") == {
        "tool:k1": OpStatus.COMMITTED,
        "tool:n1": OpStatus.COMMITTED,
    }


async def test_an_agent_tools_call_approved_in_a_state_restored_from_json_is_gated(
    ledger: stopline.Ledger,
) -> None:
    """A call of an agent used as a tool (``as_tool``) waits for approval; the state kept as
    JSON, restored and approved: the child's call passes the gate of the same run, once.
    Failed on the old code: run ungated, nothing recorded."""
    done: list[str] = []
    child, _ = approval_agent(done)
    parent = Agent(
        name="front",
        model=ScriptedModel(
            [
                [function_call("billing", {"input": "refund 7"}, call_id="p1")],
                [assistant_message("all done")],
            ]
        ),
        tools=[child.as_tool(tool_name="billing", tool_description="Billing.")],
    )
    saved = await paused_for_approval(ledger, parent, "p14-json-nest")
    state = await RunState.from_json(parent, saved)
    async with sl.run(ledger, owner="user:1", run_id="p14-json-nest") as s:
        again = await s.stream(parent, state)
    assert again.final_output == "all done"
    assert done == ["refund 7", "notify 7"]
    assert await statuses(ledger, "p14-json-nest") == {
        "tool:k1": OpStatus.COMMITTED,
        "tool:n1": OpStatus.COMMITTED,
    }


@pytest.mark.parametrize("read_back", [False, True], ids=["no-read-back", "read-back"])
async def test_a_timed_out_call_is_told_as_the_ledger_records_it(
    ledger: stopline.Ledger, read_back: bool
) -> None:
    """The SDK's ``timeout=`` cuts the call: the model is told what the receipt says of it
    (in doubt, and what settles it: a read-back, or a person). Failed on the old code for
    a tool with no read-back: "its outcome is being verified", when nothing would read
    it back and the call went to human review."""
    hang = anyio.Event()  # set at the test's end only

    async def refund(order: str) -> str:
        """Refund an order."""
        await hang.wait()
        return f"refunded {order}"

    async def verify(ctx: stopline.CallContext) -> stopline.ReadBack:
        return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, "refunds:7", "read back")

    model = ScriptedModel(
        [
            [function_call("refund", {"order": "7"}, call_id="t1")],
            [assistant_message("reported")],
        ]
    )
    # the SDK's own seconds: the body waits for ``hang``, so any cut is a cut mid-call
    agent = Agent(name="a", model=model, tools=[function_tool(refund, timeout=0.5)])
    verifiers = {"refund": verify} if read_back else {}
    try:
        async with sl.run(ledger, owner="user:1", run_id="p14-timeout", verify=verifiers) as s:
            result = await s.stream(agent, "refund order 7")
    finally:
        hang.set()
    outputs = [getattr(item, "raw_item", None) for item in result.new_items]
    (said,) = [
        str(raw["output"])
        for raw in outputs
        if isinstance(raw, dict) and raw.get("type") == "function_call_output"
    ]
    assert "may have taken effect" in said and "Do not retry" in said
    assert "The ledger records it unknown: may have happened" in said
    if read_back:
        assert "next: verify by reading the destination" in said
    else:
        assert "next: human review" in said and "being verified" not in said
