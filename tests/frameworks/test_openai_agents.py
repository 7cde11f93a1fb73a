"""OpenAI Agents SDK through stopline: the peers probe, resume, S1, S3 and S9.

The model is the SDK's own ``agents.testing.ScriptedModel`` (local, no
network): a script of responses with fixed ``call_id`` values.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from agents import Agent, function_tool, set_tracing_disabled
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

import stopline
from stopline import Cause, Headline, OpStatus, ReadBack, Verdict
from stopline.integrations import openai_agents as sl
from tests.frameworks.effects import AsyncEffect, SyncEffect, until_unknown

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def no_trace_export() -> None:
    """Nothing leaves the machine: the SDK's tracing exporter stays off."""
    set_tracing_disabled(True)


class Session:
    """An agent run started in a task group."""

    def __init__(self) -> None:
        self.handle: sl.AgentSession | None = None
        self.ready = anyio.Event()
        self.entries = 0

    @property
    def s(self) -> sl.AgentSession:
        assert self.handle is not None
        return self.handle

    async def __call__(
        self, ledger: stopline.Ledger, agent: Agent[Any], run_input: Any, run_id: str
    ) -> None:
        async with sl.run(ledger, owner="user:1", run_id=run_id) as s:
            self.handle = s
            self.entries += 1
            self.ready.set()
            await s.stream(agent, run_input)


def calls(*names: str, order: str = "9") -> list[Any]:
    return [function_call(name, {"order": order}, call_id=f"call_{name}") for name in names]


async def test_probe_openai_agents_sync_tool_commits_after_cancel_and_resume_repeats_nothing(
    ledger: stopline.Ledger,
) -> None:
    """peers.md: ``cancel(mode="immediate")`` kept no record; the sync tool committed later."""
    reserve = AsyncEffect("reserve")
    refund = SyncEffect("refund", hold=True)

    @function_tool
    async def reserve_stock(order: str) -> str:
        """Reserve stock."""
        return await reserve(order)

    @function_tool
    def issue_refund(order: str) -> str:
        """Refund an order."""
        return refund(order)

    model = ScriptedModel([calls("reserve_stock", "issue_refund"), [assistant_message("done")]])
    agent = Agent(
        name="support", model=model, tools=[sl.gated(reserve_stock), sl.gated(issue_refund)]
    )
    session = Session()
    with refund.released_at_exit():
        async with anyio.create_task_group() as tg:
            tg.start_soon(session, ledger, agent, "refund 9", "oa-probe")
            await refund.wait_reached()
            at_cancel = await session.s.cancel(by="user:1", reason="stop")
            assert at_cancel.run_state is stopline.RunState.CANCELLING
            await until_unknown(ledger, "oa-probe/tool:call_issue_refund")
            refund.release.set()
    receipt = await ledger.wait_settled("oa-probe", timeout=10)
    ops = {op.id: op for op in await ledger.backend.operations("oa-probe")}
    assert set(ops) == {"oa-probe/tool:call_reserve_stock", "oa-probe/tool:call_issue_refund"}
    late = ops["oa-probe/tool:call_issue_refund"]
    assert late.status is OpStatus.COMMITTED and late.cause is Cause.USER_CANCEL
    assert late.result == "refund:9"
    assert any(e.data.get("late") for e in await ledger.backend.events("oa-probe"))
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS

    # resume from the SDK's RunState: the calls come back with their ids; nothing repeats
    assert session.s.result is not None
    state = session.s.result.to_state()
    await ledger.resume("oa-probe", by="user:1")
    again = Session()
    await again(ledger, agent, state, "oa-probe")
    assert again.s.result is not None and again.s.result.final_output == "done"
    assert reserve.effects == ["9"] and refund.effects == ["9"]  # neither repeated
    assert (await ledger.receipt("oa-probe")).headline is Headline.COMPLETED


async def test_s01_openai_agents_cancel_before_the_tool_call(
    unwatched: stopline.Ledger, ledger_url: str
) -> None:
    """Cancelled from another process before the tool call: the gate refuses it."""
    ledger = unwatched  # a worker that does not watch: its gate is where it learns
    refund = AsyncEffect("refund")
    thinking = anyio.Event()

    @function_tool
    async def issue_refund(order: str) -> str:
        """Refund an order."""
        return await refund(order)

    async def think(call: Any) -> Any:  # the model's answer waits until the test says
        await thinking.wait()
        return calls("issue_refund")

    model = ScriptedModel([ModelStep.respond(think), [assistant_message("done")]])
    agent = Agent(name="support", model=model, tools=[sl.gated(issue_refund)])
    session = Session()
    async with anyio.create_task_group() as tg:
        tg.start_soon(session, ledger, agent, "refund 9", "oa-s01")
        await session.ready.wait()
        async with stopline.open(ledger_url) as elsewhere:
            first = await elsewhere.cancel("oa-s01", by="user:1")
        assert first.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
        thinking.set()
    receipt = await ledger.wait_settled("oa-s01", timeout=10)
    assert refund.effects == []
    assert [line.status for line in receipt.lines] == [OpStatus.PREVENTED]
    assert receipt.message == "Canceled before external action."


@pytest.mark.parametrize("verifier_form", ["ctx", "key"])
async def test_s03_openai_agents_cancel_after_commit_before_response(
    ledger: stopline.Ledger, verifier_form: str
) -> None:
    """The provider committed; the run is cancelled before the answer: unknown, verified.

    The verifier takes the call's context (the one signature); the earlier form
    taking the key alone still works in 0.2, with a ``DeprecationWarning``."""
    truth: dict[str, str] = {}
    committed = anyio.Event()

    @function_tool
    async def notify(order: str) -> str:
        """Notify the customer."""
        truth["notify"] = order
        committed.set()
        await anyio.sleep_forever()  # the answer never comes back
        return "unreachable"

    async def read_back(ctx: stopline.CallContext) -> ReadBack:
        found = "notify" in truth
        return ReadBack(Verdict.COMMITTED if found else Verdict.NOT_COMMITTED, "notify:1")

    async def read_back_by_key(key: str) -> ReadBack:  # the form deprecated in 0.2
        assert key == "oa-s03/tool:call_notify"
        found = "notify" in truth
        return ReadBack(Verdict.COMMITTED if found else Verdict.NOT_COMMITTED, "notify:1")

    model = ScriptedModel([calls("notify"), [assistant_message("done")]])
    if verifier_form == "ctx":
        gated = sl.gated(notify, verify=read_back)
    else:
        with pytest.warns(DeprecationWarning, match="take the call's context"):
            gated = sl.gated(notify, verify=read_back_by_key)
    agent = Agent(name="support", model=model, tools=[gated])
    session = Session()
    async with anyio.create_task_group() as tg:
        tg.start_soon(session, ledger, agent, "notify", "oa-s03")
        await committed.wait()
        await session.s.cancel(by="user:1")
    receipt = await ledger.wait_settled("oa-s03", timeout=10)
    (op,) = await ledger.backend.operations("oa-s03")
    kinds = [e.kind for e in await ledger.backend.events("oa-s03") if e.op_id == op.id]
    assert kinds.index("lost") < kinds.index("verified_committed")  # unknown, then proven
    assert op.status is OpStatus.COMMITTED and op.cause is Cause.USER_CANCEL
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_s09_openai_agents_late_success_after_cancel(ledger: stopline.Ledger) -> None:
    """The remote answers after the run was cancelled: kept, committed, run not restarted."""
    accepted = anyio.Event()

    @function_tool
    async def pay(order: str) -> str:
        """Pay the supplier."""
        accepted.set()
        await anyio.sleep_forever()
        return "unreachable"

    async def still_processing(ctx: stopline.CallContext) -> ReadBack:
        return ReadBack(Verdict.UNKNOWN, detail="the PSP has not answered yet")

    model = ScriptedModel([calls("pay"), [assistant_message("done")]])
    agent = Agent(name="support", model=model, tools=[sl.gated(pay, verify=still_processing)])
    session = Session()
    async with anyio.create_task_group() as tg:
        tg.start_soon(session, ledger, agent, "pay", "oa-s09")
        await accepted.wait()
        await session.s.cancel(by="user:1")
    (op,) = await ledger.backend.operations("oa-s09")
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)  # R3: not "not sent"
    late = await ledger.late_response(op.id, Verdict.COMMITTED, result="paid", ref="psp:1")
    assert late.status is OpStatus.COMMITTED and late.result == "paid"
    receipt = await ledger.wait_settled("oa-s09", timeout=10)
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert any(e.data.get("late") for e in await ledger.backend.events("oa-s09"))
    assert session.entries == 1 and len(model.calls) == 1  # neither run nor model restarted
