"""Rules R1, R3, R4, R7, R8 of CONTRACT.md against a real SQLite ledger."""

from __future__ import annotations

import anyio
import pytest

import stopline
from stopline import Cause, Headline, OpStatus, PhaseKind, Policy, Verdict
from stopline.domain.lifecycle import Principal
from stopline.testing import FakeProvider
from tests.scenarios.workflows import Started, calls, start


async def test_r1_no_requested_after_the_cancel_in_ledger_order(ledger: stopline.Ledger) -> None:
    """Thirty concurrent dispatches race a cancel; the ledger orders them all."""
    received: list[str] = []
    tenth, release = anyio.Event(), anyio.Event()

    @stopline.tool
    async def send(ctx: stopline.CallContext, n: int) -> int:
        received.append(ctx.key)
        if len(received) == 10:
            tenth.set()
        if len(received) >= 10:
            await release.wait()  # the run cannot finish before the cancel lands
        return n

    async def body(run: stopline.Run, started: Started) -> None:
        async with anyio.create_task_group() as tg:
            for n in range(30):
                tg.start_soon(run.call, send, n)

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await tenth.wait()
        await ledger.cancel(started.run_id, by="user:1")
        release.set()
    await ledger.wait_settled(started.run_id, timeout=10)
    events = await ledger.backend.events(started.run_id)
    cancel = next(e.seq for e in events if e.kind == "cancel")
    passed = {e.op_id for e in events if e.kind == "gate_passed"}
    assert all(e.seq < cancel for e in events if e.kind == "gate_passed")
    assert all(e.seq > cancel for e in events if e.kind == "gate_refused")
    assert set(received) <= passed  # nothing reached the provider without passing the gate
    assert started.error is None  # RunFenced inside the workflow's task group was absorbed
    for op in await ledger.backend.operations(started.run_id):
        if op.status is OpStatus.NOT_COMMITTED:  # passed, then stopped before its first byte
            assert op.id not in received
        else:
            assert op.status in {OpStatus.COMMITTED, OpStatus.PREVENTED}


async def test_r3_timeout_is_unknown_not_not_committed(ledger: stopline.Ledger) -> None:
    never = anyio.Event()

    @stopline.tool
    async def wire(ctx: stopline.CallContext) -> None:
        await never.wait()

    async def body(run: stopline.Run, started: Started) -> None:
        await run.call(wire, timeout=0.05)

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
    assert isinstance(started.error, TimeoutError)
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    op = (await ledger.backend.operations(started.run_id))[0]
    assert op.cause is Cause.TIMEOUT
    # no verifier: the unknown goes to a human, never to "did not happen"
    assert op.status is OpStatus.NEEDS_REVIEW
    transitions = [e.to_state for e in await ledger.backend.events(started.run_id) if e.op_id]
    assert transitions == ["requested", "unknown", "needs_review"]
    assert receipt.headline is Headline.NEEDS_REVIEW


async def test_r3_local_abort_is_unknown(ledger: stopline.Ledger) -> None:
    post = FakeProvider("post", verifiable=False)
    held = post.hold("accepted")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(post, policy=Policy.IMMEDIATE))
        await held.reached.wait()
        await ledger.cancel(started.run_id, by="user:1")
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    op = (await ledger.backend.operations(started.run_id))[0]
    assert op.status is OpStatus.NEEDS_REVIEW  # unknown, no read-back: review
    assert op.cause is Cause.USER_CANCEL
    assert receipt.headline is Headline.NEEDS_REVIEW


async def test_r4_late_rejection_settles_an_unknown(ledger: stopline.Ledger) -> None:
    post = FakeProvider("post", verifiable=False)
    held = post.hold("accepted")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(post, policy=Policy.IMMEDIATE))
        await held.reached.wait()
        await ledger.cancel(started.run_id, by="user:1")
    op = (await ledger.backend.operations(started.run_id))[0]
    late = await ledger.late_response(op.id, Verdict.NOT_COMMITTED, ref="post:declined")
    assert late.status is OpStatus.NOT_COMMITTED
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert started.entries == 1


async def test_r4_late_response_contradicting_a_read_back_goes_to_review(
    ledger: stopline.Ledger,
) -> None:
    post = FakeProvider("post")
    held = post.hold("accepted")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(post, policy=Policy.IMMEDIATE))
        await held.reached.wait()
        await ledger.cancel(started.run_id, by="user:1")
    first = await ledger.wait_settled(started.run_id, timeout=10)
    assert first.lines[0].status is OpStatus.NOT_COMMITTED  # the read-back found nothing
    op_id = first.lines[0].op_id
    # ... and then a success arrives for it: the evidence disagrees, a human decides
    late = await ledger.late_response(op_id, Verdict.COMMITTED, result="posted")
    assert late.status is OpStatus.NEEDS_REVIEW
    events = [e for e in await ledger.backend.events(started.run_id) if e.kind == "conflict"]
    assert events and "contradicts" in events[0].data["error"]


async def test_r4_unknown_verdict_is_kept_without_changing_status(
    ledger: stopline.Ledger,
) -> None:
    post = FakeProvider("post")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(post))
    op = (await ledger.backend.operations(started.run_id))[0]
    kept = await ledger.late_response(op.id, Verdict.UNKNOWN, result={"echo": 1})
    assert kept.status is OpStatus.COMMITTED
    assert (await ledger.backend.events(started.run_id))[-1].kind == "late_response"


async def test_r7_concurrent_cancels_make_one_cancellation(ledger: stopline.Ledger) -> None:
    send = FakeProvider("send")
    held = send.hold("received")
    receipts: list[stopline.Receipt] = []

    async def cancel(who: str) -> None:
        admin = Principal(who, tenant="default", roles=frozenset({"admin"}))
        receipts.append(await ledger.cancel(started.run_id, by=admin))

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(send))
        await held.reached.wait()
        async with anyio.create_task_group() as cancels:
            for n in range(10):
                cancels.start_soon(cancel, f"user:{n}")
    events = await ledger.backend.events(started.run_id)
    assert [e.kind for e in events].count("cancel") == 1
    assert len({r.cancelled_by for r in receipts}) == 1
    assert len(send.cancel_requests) == 1


async def test_r8_receipt_at_each_point_claims_no_more_than_the_ledger(
    ledger: stopline.Ledger,
) -> None:
    """Sampled at every barrier of a refused cancel, the headline matches the evidence."""
    deploy = FakeProvider("deploy", cancellable=stopline.Cancellable.NEVER)
    accepted = deploy.hold("accepted")
    responding = deploy.hold("responding")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(deploy))
        await accepted.reached.wait()
        assert (await ledger.receipt(started.run_id)).headline is Headline.RUNNING
        at_cancel = await ledger.cancel(started.run_id, by="user:1")
        # R14: its provider is not asked to cancel: no vendor confirmation is awaited
        assert at_cancel.headline is Headline.VERIFYING
        # R12: said while in flight; of ``never`` (also the default), what the record
        # proves: no way to cancel declared, none asked (ADR 0066)
        assert at_cancel.lines[0].provider_cancel.startswith("not declared cancellable")
        accepted.release()
        await responding.reached.wait()  # committed at the provider, not yet answered
        mid = await ledger.receipt(started.run_id)
        assert mid.headline is Headline.VERIFYING  # the ledger cannot know yet
        responding.release()
    final = await ledger.wait_settled(started.run_id, timeout=10)
    assert final.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_phase_policy_at_boundary_lets_the_step_finish(ledger: stopline.Ledger) -> None:
    first = FakeProvider("first", cancellable=stopline.Cancellable.NEVER)
    second = FakeProvider("second")
    held = first.hold("received")

    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.WAITING_CALLBACK):  # at_boundary
            await run.call(first.tool, "a")
            await run.call(second.tool, "b")

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await held.reached.wait()
        await ledger.cancel(started.run_id, by="user:1")
        held.release()
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert second.requests == []  # stopped at the boundary after the first step


async def test_deferred_outcomes_are_read_in_order(ledger_url: str) -> None:
    """durable_outcomes=False: a call returns before its outcome commits, yet every later
    read of this process sees it (one writer, first in first out), and closing the ledger
    leaves it durable."""
    send = FakeProvider("send")
    async with stopline.open(ledger_url, durable_outcomes=False) as ledger:
        async with ledger.run("job", owner="user:1") as run:
            for n in range(20):
                await run.call(send.tool, n)
                receipt = await ledger.receipt(run.id)
                assert receipt.lines[-1].status is OpStatus.COMMITTED
        assert (await ledger.receipt(run.id)).headline is Headline.COMPLETED
    async with stopline.open(ledger_url) as reopened:
        ops = await reopened.backend.operations(run.id)
    assert [op.status for op in ops] == [OpStatus.COMMITTED] * 20
    assert len(send.effects) == 20


@pytest.mark.parametrize("policy", [Policy.VERIFY, Policy.AT_BOUNDARY])
async def test_r2_a_sibling_refused_at_the_gate_lets_the_call_in_flight_finish(
    ledger: stopline.Ledger, policy: Policy
) -> None:
    """Under ``verify`` and ``at_boundary`` a call in flight finishes (R2): a sibling call
    refused at the gate raises ``RunFenced`` only after it, so the workflow's own task
    group does not interrupt it (an interrupted call would be ``unknown``)."""
    first = FakeProvider("first", cancellable=stopline.Cancellable.NEVER)
    second = FakeProvider("second")
    held = first.hold("received")
    cancelled = anyio.Event()

    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, policy), anyio.create_task_group() as tg:
            tg.start_soon(run.call, first.tool, "a")
            await cancelled.wait()
            await run.call(second.tool, "b")  # refused at the gate, after the cancel

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await held.reached.wait()
        await ledger.cancel(started.run_id, by="user:1")
        cancelled.set()
        events = ledger.backend.events
        while not any(e.kind == "gate_refused" for e in await events(started.run_id)):
            await ledger.wait_for_change(started.run_id, poll=0.02)
        held.release()
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert [(line.what, line.status) for line in receipt.lines] == [
        ("first", OpStatus.COMMITTED),
        ("second", OpStatus.PREVENTED),
    ]
    assert second.requests == []
    assert started.error is None
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_r2_a_tool_calling_run_call_is_not_waited_for_by_its_own_fence(
    ledger: stopline.Ledger,
) -> None:
    """A call made inside a tool (a sub-step) meets the fence at once: the fence does not
    wait for the call it is inside of, which could never end first."""
    inner = FakeProvider("inner")
    inside = anyio.Event()
    go_on = anyio.Event()
    holder: list[stopline.Run] = []

    @stopline.tool
    async def outer(ctx: stopline.CallContext) -> str:
        inside.set()
        await go_on.wait()
        with pytest.raises(stopline.RunFenced):
            await holder[0].call(inner.tool, "x")
        return "outer done"

    async def body(run: stopline.Run, started: Started) -> None:
        holder.append(run)
        async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.VERIFY):
            await run.call(outer)

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await inside.wait()
        await ledger.cancel(started.run_id, by="user:1")
        go_on.set()
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert [(line.what, line.status) for line in receipt.lines] == [
        ("outer", OpStatus.COMMITTED),
        ("inner", OpStatus.PREVENTED),
    ]
    assert inner.requests == []
