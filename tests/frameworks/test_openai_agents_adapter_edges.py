"""OpenAI Agents SDK adapter: the edges a probe found (arguments spelled another way on
resume, a tool raising a BaseException, ``Handoff`` objects, agents used as tools, the
resume note, a refused cancel).

Real agents with the SDK's own ``ScriptedModel``; real ledgers; barriers, never sleeps.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from agents import Agent, function_tool, handoff, set_tracing_disabled
from agents import Tool as AgentsTool
from agents.testing import ScriptedModel, assistant_message, function_call

import stopline
from stopline import OpStatus, Policy, RunState
from stopline.integrations import openai_agents as sl
from tests.frameworks.effects import SyncEffect, until_unknown

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def no_trace_export() -> None:
    set_tracing_disabled(True)


@pytest.fixture
def held() -> Iterator[SyncEffect]:
    with SyncEffect("held", hold=True).released_at_exit() as effect:
        yield effect


async def cancel_while_held(
    ledger: stopline.Ledger, agent: Agent[Any], run_id: str, effect: SyncEffect, op_id: str
) -> None:
    """Run ``agent`` until ``effect`` holds its thread, cancel, release it; resume the run."""
    sessions: list[sl.AgentSession] = []

    async def go() -> None:
        async with sl.run(ledger, owner="user:1", run_id=run_id) as s:
            sessions.append(s)
            await s.stream(agent, "go")

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        await effect.wait_reached()
        await sessions[0].cancel(by="user:1")
        await until_unknown(ledger, op_id)
        effect.release.set()
    await ledger.wait_settled(run_id, timeout=10)
    await ledger.resume(run_id, by="user:1")


async def test_resume_matches_the_same_json_spelled_another_way(
    ledger: stopline.Ledger, held: SyncEffect
) -> None:
    """Key order and spaces differ; the parsed arguments are the same: the re-issued
    call is the recorded operation, its result replayed, no second refund."""

    @function_tool
    def refund(order: str, amount: int) -> str:
        """Refund an order."""
        return held((order, amount))

    first = ScriptedModel(
        [
            [function_call("refund", '{"order":"1042","amount":5}', call_id="c1")],
            [assistant_message("done")],
        ]
    )
    await cancel_while_held(
        ledger, Agent(name="a", model=first, tools=[refund]), "oa-e-json", held, "oa-e-json/tool:c1"
    )
    again = ScriptedModel(
        [
            [function_call("refund", '{"amount": 5, "order": "1042"}', call_id="c9")],
            [assistant_message("done")],
        ]
    )
    async with sl.run(ledger, owner="user:1", run_id="oa-e-json") as s:
        await s.stream(Agent(name="a", model=again, tools=[refund]), "go")
    assert held.effects == [("1042", 5)]
    assert [op.id for op in await ledger.backend.operations("oa-e-json")] == ["oa-e-json/tool:c1"]


class Halt(BaseException):
    """Not an ``Exception``: as ``SystemExit`` or ``KeyboardInterrupt`` would be."""


async def test_def_tool_raising_a_base_exception_fails_its_own_call_only(
    ledger: stopline.Ledger,
) -> None:
    other_started, other_go = anyio.Event(), anyio.Event()
    paid: list[str] = []

    @function_tool
    def pay(order: str) -> str:
        """Pay."""
        paid.append(order)
        raise Halt("halt after paying")

    @function_tool
    async def slow(x: str) -> str:
        """Harmless, waits for the test."""
        other_started.set()
        await other_go.wait()
        return "ok"

    def agent(tool: Any, args: dict[str, Any]) -> Agent[Any]:
        model = ScriptedModel(
            [[function_call(tool.name, args, call_id="c1")], [assistant_message("done")]]
        )
        return Agent(name=tool.name, model=model, tools=[tool])

    async def unrelated() -> None:
        async with sl.run(ledger, owner="user:2", run_id="oa-e-other") as s:
            await s.stream(agent(slow, {"x": "1"}), "go")

    async with anyio.create_task_group() as tg:
        tg.start_soon(unrelated)
        await other_started.wait()
        with pytest.raises(Halt):
            async with sl.run(ledger, owner="user:1", run_id="oa-e-halt") as s:
                await s.stream(agent(pay, {"order": "1"}), "pay")
        other_go.set()
    assert paid == ["1"]
    assert (await ledger.backend.get_run("oa-e-other")).state is RunState.COMPLETED
    op = await ledger.backend.get_operation("oa-e-halt/tool:c1")
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)


async def test_a_handoff_object_leads_to_a_gated_agent(ledger: stopline.Ledger) -> None:
    """``handoff(agent)``: the agent it returns has its tools gated."""
    refunded: list[str] = []

    @function_tool
    async def refund(order: str) -> str:
        """Refund an order."""
        refunded.append(order)
        return f"refunded {order}"

    billing = Agent(
        name="billing",
        tools=[refund],
        model=ScriptedModel(
            [[function_call("refund", {"order": "1042"}, call_id="b1")], [assistant_message("ok")]]
        ),
    )
    triage = Agent(
        name="triage",
        handoffs=[handoff(billing)],
        model=ScriptedModel([[function_call("transfer_to_billing", {}, call_id="h1")]]),
    )
    async with sl.run(ledger, owner="user:1", run_id="oa-e-handoff") as s:
        await s.stream(triage, "refund 1042")
    assert refunded == ["1042"]
    ops = await ledger.backend.operations("oa-e-handoff")
    assert [(op.tool, op.status) for op in ops] == [("refund", OpStatus.COMMITTED)]


async def test_after_turn_cancel_fences_an_agent_used_as_a_tool(ledger: stopline.Ledger) -> None:
    """R1: the child agent's next tool call, after the fence, does not pass the gate."""
    in_first, go_on = anyio.Event(), anyio.Event()
    steps: list[int] = []

    @function_tool
    async def step(n: int) -> str:
        """One effectful step."""
        if n == 1:
            in_first.set()
            await go_on.wait()
        steps.append(n)
        return f"step {n}"

    child = Agent(
        name="worker",
        tools=[step],
        model=ScriptedModel(
            [
                [function_call("step", {"n": 1}, call_id="w1")],
                [function_call("step", {"n": 2}, call_id="w2")],
                [assistant_message("all steps done")],
            ]
        ),
    )
    parent = Agent(
        name="boss",
        tools=[child.as_tool("do_work", "Do the work")],
        model=ScriptedModel(
            [[function_call("do_work", {"input": "go"}, call_id="p1")], [assistant_message("ok")]]
        ),
    )
    sessions: list[sl.AgentSession] = []

    async def go() -> None:
        async with sl.run(ledger, owner="user:1", run_id="oa-e-astool") as s:
            sessions.append(s)
            await s.stream(parent, "work")

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        await in_first.wait()
        await sessions[0].cancel(by="user:1", mode="after_turn")
        go_on.set()
    await ledger.wait_settled("oa-e-astool", timeout=10)
    assert steps == [1]
    ops = await ledger.backend.operations("oa-e-astool")
    assert [(op.id, op.status) for op in ops] == [("oa-e-astool/tool:w1", OpStatus.COMMITTED)]


async def test_resume_note_says_what_each_recorded_call_proves(
    ledger: stopline.Ledger, held: SyncEffect
) -> None:
    """Did not happen: may be called again; done: do not repeat, and a result that was
    not kept is said so, never ``null``."""

    @function_tool
    async def refund(order: str) -> str:
        """Refund an order."""
        raise stopline.Rejected(f"{order} is closed")  # the provider refused: nothing done

    @function_tool
    async def allocate(n: int) -> set[int]:
        """Allocate n slots."""
        return set(range(n))  # not JSON: the ledger keeps its digest only

    @function_tool
    def wait(x: str) -> str:
        """Hold the turn."""
        return held(x)

    tools: list[AgentsTool] = [refund, allocate, wait]
    first = ScriptedModel(
        [
            [
                function_call("refund", {"order": "1042"}, call_id="c1"),
                function_call("allocate", {"n": 3}, call_id="c2"),
                function_call("wait", {"x": "1"}, call_id="c3"),
            ],
            [assistant_message("done")],
        ]
    )
    agent = Agent(name="a", model=first, tools=tools)
    await cancel_while_held(ledger, agent, "oa-e-note", held, "oa-e-note/tool:c3")
    again = ScriptedModel([[assistant_message("nothing to do")]])
    async with sl.run(ledger, owner="user:1", run_id="oa-e-note") as s:
        await s.stream(Agent(name="a", model=again, tools=tools), "go")
    (note,) = [
        item["content"]
        for item in again.calls[0].input
        if isinstance(item, dict) and item.get("role") == "developer"
    ]
    lines = {line.split(" ")[2]: line for line in note.splitlines()[1:]}
    assert "did not happen; it may be called again" in lines["(tool:c1):"]
    assert "committed: completed; do not repeat it" in lines["(tool:c2):"]
    assert "result was not kept" in lines["(tool:c2):"] and "null" not in lines["(tool:c2):"]
    assert "committed: completed; do not repeat it" in lines["(tool:c3):"]
    assert "these calls are done" not in note


async def test_a_refused_cancel_leaves_the_run_policy_as_it_was(ledger: stopline.Ledger) -> None:
    """R11: checked first; a principal who may not cancel changes nothing."""
    async with sl.run(ledger, owner="user:1", run_id="oa-e-refused") as s:
        with pytest.raises(stopline.NotPermitted):
            await s.cancel(by="mallory", mode="after_turn")
        assert s.bound.run.policy is Policy.VERIFY
        assert not s.bound.run.cancel_requested
