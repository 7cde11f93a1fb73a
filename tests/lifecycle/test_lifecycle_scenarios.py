"""CONTRACT.md S4, S5, S6, S12, S13, S14 and rules R6, R9, R10, R11 on a real SQLite ledger."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import stopline
from stopline import Cancellable, Headline, OpStatus, PhaseKind, RunState
from stopline.domain.lifecycle import ApprovalStatus, Principal
from stopline.errors import NotPermitted, UnknownRun
from stopline.runtime.lifecycle import ApprovalNeeded, Retry
from stopline.testing import FakeProvider
from tests.scenarios.workflows import Started, start


async def test_s04_cancel_during_a_subagent_handoff(ledger: stopline.Ledger) -> None:
    """The child gets no new dispatch; its operations appear in the parent's receipt."""
    research, write = FakeProvider("research", cancellable=Cancellable.NEVER), FakeProvider("write")
    held = research.hold("accepted")
    child_ids: list[str] = []

    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.HANDOFF), run.child("researcher") as child:
            child_ids.append(child.id)
            await child.call(research.tool, "topic")
            await child.call(write.tool, "draft")

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await held.reached.wait()
        receipt = await ledger.cancel(started.run_id, by="user:1", reason="wrong topic")
        # the child's call, in flight; never cancellable, its provider is not asked (R14)
        assert receipt.headline is Headline.VERIFYING
        held.release()
    final = await ledger.wait_settled(started.run_id, timeout=10)
    # each run settles in its own step: the parent's may land before its child's
    await ledger.wait_settled(child_ids[0], timeout=10)
    child = await ledger.backend.get_run(child_ids[0])
    assert child.state is RunState.CANCELLED and not child.grants & stopline.Grant.INITIATE
    assert write.requests == []  # no new dispatch in the child after the fence
    assert [line.op_id.split("/")[0] for line in final.lines] == [child_ids[0]]
    assert final.lines[0].status is OpStatus.COMMITTED  # the handed-off step finished
    assert final.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_s05_cancel_after_an_approval_expired(ledger: stopline.Ledger) -> None:
    """The approval is withdrawn; nothing is dispatched on it."""
    pay = FakeProvider("pay")
    asked = anyio.Event()
    approvals: list[str] = []
    outcomes: list[str] = []

    async def body(run: stopline.Run, started: Started) -> None:
        approval = await run.request_approval("pay", approver="manager:1")
        approvals.append(approval.id)
        asked.set()
        await anyio.sleep_forever()  # awaiting approval (immediate: cancel interrupts)

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await asked.wait()
        await ledger.approve(approvals[0], by="manager:1", ttl=0)  # granted, and expired at once
        with pytest.raises(ApprovalNeeded, match="expired"):
            await ledger.dispatch(started.run_id, pay.tool, 100, key="pay", needs_approval=True)
        await ledger.cancel(started.run_id, by="user:1")
        try:
            await ledger.dispatch(started.run_id, pay.tool, 100, key="pay", needs_approval=True)
        except stopline.RunFenced:
            outcomes.append("refused")
    (approval,) = await ledger.backend.approvals(started.run_id)
    assert approval.status is ApprovalStatus.WITHDRAWN
    assert outcomes == ["refused"] and pay.requests == []
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION


async def test_s06_cancel_then_resume_from_the_last_checkpoint(ledger: stopline.Ledger) -> None:
    """Resume from the last evidenced checkpoint; no operation is repeated."""
    send, publish = FakeProvider("send"), FakeProvider("publish")
    second = anyio.Event()
    entries: list[Any] = []

    async def workflow(run: stopline.Run, started: Started | None = None) -> None:
        resumed = await ledger.backend.last_checkpoint(run.id)
        entries.append(None if resumed is None else resumed.state)
        await run.call(send.tool, "draft", key="send")
        await run.checkpoint("sent", {"next": "publish"})
        second.set()
        await anyio.sleep_forever()  # thinking; the user cancels here
        await run.call(publish.tool, "post", key="publish")

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, workflow)
        await second.wait()
        await ledger.cancel(started.run_id, by="user:1", reason="change scope")
    await ledger.wait_settled(started.run_id, timeout=10)
    resumed = await ledger.resume(started.run_id, by="user:1")
    assert resumed.checkpoint is not None and resumed.checkpoint.name == "sent"
    assert resumed.checkpoint.operations == (f"{started.run_id}/send",)

    async def rest(run: stopline.Run) -> None:
        checkpoint = await ledger.backend.last_checkpoint(run.id)
        entries.append(None if checkpoint is None else checkpoint.state)
        await run.call(send.tool, "draft", key="send")  # before the checkpoint: not repeated
        await run.call(publish.tool, "post", key="publish")

    async with ledger.run("job", owner="user:1", run_id=started.run_id) as run:
        await rest(run)
    assert entries == [None, {"next": "publish"}]
    assert send.effects == [f"{started.run_id}/send"]  # once, across cancel and resume
    assert publish.effects == [f"{started.run_id}/publish"]
    final = await ledger.wait_settled(started.run_id, timeout=10)
    assert final.headline is Headline.COMPLETED


async def test_s06_resume_refused_while_an_operation_is_unresolved(
    ledger: stopline.Ledger,
) -> None:
    post = FakeProvider("post", verifiable=False)
    held = post.hold("accepted")
    async with anyio.create_task_group() as tg:
        body = _call_in_phase(post, stopline.Policy.IMMEDIATE)
        started = start(tg, ledger, body)
        await held.reached.wait()
        await ledger.cancel(started.run_id, by="user:1")
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.headline is Headline.NEEDS_REVIEW
    with pytest.raises(stopline.RunEnded, match="review"):  # R14: says what to do
        await ledger.resume(started.run_id, by="user:1")


def _call_in_phase(provider: FakeProvider, policy: stopline.Policy) -> Any:
    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, policy):
            await run.call(provider.tool, "x")

    return body


async def test_s12_another_users_task_on_the_same_connector(ledger: stopline.Ledger) -> None:
    """One connector (one provider object, one 'connection') carries two users' runs."""
    connector = FakeProvider("crm", cancellable=Cancellable.NEVER)
    mine = connector.hold("accepted")

    async with anyio.create_task_group() as tg:
        first = start(
            tg, ledger, _call_in_phase(connector, stopline.Policy.IMMEDIATE), owner="user:1"
        )
        await mine.reached.wait()
        theirs = connector.hold("accepted")
        second = start(
            tg, ledger, _call_in_phase(connector, stopline.Policy.IMMEDIATE), owner="user:2"
        )
        await theirs.reached.wait()
        await ledger.cancel(first.run_id, by="user:1")
        assert connector.cancel_requests == []  # the shared connector was asked nothing
        theirs.release()
        mine.release()
    other = await ledger.wait_settled(second.run_id, timeout=10)
    assert other.headline is Headline.COMPLETED
    assert other.lines[0].status is OpStatus.COMMITTED
    assert second.error is None
    assert connector.effects.count(other.lines[0].op_id) == 1


async def test_s13_shared_background_work_goes_on(ledger: stopline.Ledger) -> None:
    """A shared refresh serving two runs survives one owner's cancel; its ownership drops it.

    The refresh runs in a task of its own, as background work does: a block inside the
    cancelled owner's block is interrupted with it (its task is being cancelled), and
    its next call is not sent."""
    refresh = FakeProvider("refresh", cancellable=Cancellable.NEVER)
    opened, cancelled = anyio.Event(), anyio.Event()
    owners: list[str] = []

    async def owner_a() -> None:
        async with ledger.run("a", owner="user:1") as a:
            owners.append(a.id)
            opened.set()
            await anyio.sleep_forever()  # until its cancel interrupts it
        cancelled.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(owner_a)
        await opened.wait()
        await shared_refresh(ledger, refresh, owners[0], cancelled)


async def shared_refresh(
    ledger: stopline.Ledger, refresh: FakeProvider, a_id: str, cancelled: anyio.Event
) -> None:
    async with (
        ledger.run("b", owner="user:1") as b,
        ledger.run("refresh", owner="user:1", parent_id=a_id, shared=True) as shared,
    ):
        await ledger.share(shared.id, with_owner=b.id, by="user:1")
        await ledger.cancel(a_id, by="user:1")
        await cancelled.wait()  # a's block was interrupted
        assert (await ledger.backend.get_run(shared.id)).state is RunState.RUNNING
        await shared.call(refresh.tool, "cache")  # still dispatches for b
        events = await ledger.backend.events(shared.id)
        assert any(e.kind == "owner_released" for e in events)
        await ledger.cancel(b.id, by="user:1")  # the last owner goes: now it is fenced
        fenced = await ledger.backend.get_run(shared.id)
        assert fenced.state in {RunState.CANCELLING, RunState.SETTLING, RunState.CANCELLED}
        assert not fenced.grants & stopline.Grant.INITIATE
    assert refresh.effects == [f"{shared.id}/1:refresh"]


async def test_s14_queue_redelivery_after_cancel(ledger: stopline.Ledger) -> None:
    """A redelivered message is refused at the gate; a redelivery of a done one repeats nothing."""
    ship = FakeProvider("ship")
    async with ledger.run("orders", owner="user:1") as run:
        first = await ledger.dispatch(run.id, ship.tool, "order-1", key="msg-1")
        again = await ledger.dispatch(run.id, ship.tool, "order-1", key="msg-1")  # redelivered
        assert again == first and len(ship.effects) == 1
        await ledger.cancel(run.id, by="user:1")
        with pytest.raises(stopline.RunFenced):
            await ledger.dispatch(run.id, ship.tool, "order-2", key="msg-2")
        with pytest.raises(stopline.RunFenced):  # redelivered after the cancel
            await ledger.dispatch(run.id, ship.tool, "order-2", key="msg-2")
    assert ship.requests == [f"{run.id}/msg-1"]
    ops = {op.id: op.status for op in await ledger.backend.operations(run.id)}
    assert ops[f"{run.id}/msg-2"] is OpStatus.PREVENTED


async def test_r09_pause_is_not_cancel(ledger: stopline.Ledger) -> None:
    """Pause lets the in-flight call finish, holds the next one at the gate, resume lets it go."""
    first, second = FakeProvider("first", cancellable=Cancellable.NEVER), FakeProvider("second")
    held = first.hold("accepted")

    async def body(run: stopline.Run, started: Started) -> None:
        await run.call(first.tool, "a")
        await run.call(second.tool, "b")

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await held.reached.wait()
        paused = await ledger.pause(started.run_id, by="user:1")
        assert paused.headline is Headline.PAUSED
        again = await ledger.pause(started.run_id, by="user:1")  # idempotent while pausing
        assert again.headline is Headline.PAUSED
        held.release()
        while (await ledger.backend.get_run(started.run_id)).state is not RunState.PAUSED:
            await ledger.wait_for_change(started.run_id)
        assert (await ledger.pause(started.run_id, by="user:1")).headline is Headline.PAUSED
        kinds = [e.kind for e in await ledger.backend.events(started.run_id) if e.op_id is None]
        assert kinds.count("pause") == 1  # a pause that found it done wrote nothing
        assert first.effects and second.requests == []  # finished; next one held
        run = await ledger.backend.get_run(started.run_id)
        assert run.grants & stopline.Grant.INITIATE  # pause suspends, it does not revoke
        await ledger.resume(started.run_id, by="user:1")
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.headline is Headline.COMPLETED and len(second.effects) == 1


async def test_retry_attempts_pass_the_gate_with_one_id(ledger: stopline.Ledger) -> None:
    attempts: list[str] = []
    fire = anyio.Event()

    @stopline.tool
    async def flaky(ctx: stopline.CallContext) -> str:
        attempts.append(ctx.key)
        if len(attempts) < 3:
            raise stopline.Rejected("busy")
        return "ok"

    async with ledger.run("job", owner="user:1") as run:
        assert await run.call(flaky, retry=Retry(attempts=3, backoff=0)) == "ok"
    assert len(set(attempts)) == 1 and len(attempts) == 3
    op = (await ledger.backend.operations(run.id))[0]
    assert op.attempts == 3 and op.status is OpStatus.COMMITTED

    attempts.clear()

    async def body(r: stopline.Run, started: Started) -> None:
        await r.call(flaky, retry=Retry(attempts=5, backoff=0.01))

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        while not attempts:
            await ledger.wait_for_change(started.run_id)
        await ledger.cancel(started.run_id, by="user:1")
        fire.set()
    assert len(attempts) < 5  # the attempts after the fence were refused at the gate


async def test_r06_children_race_the_subtree_fence(ledger: stopline.Ledger) -> None:
    """Ten child runs dispatch in a loop while their parent is cancelled, many times."""
    for iteration in range(5):
        provider = FakeProvider(f"p{iteration}", cancellable=Cancellable.NEVER)
        go = anyio.Event()
        child_ids: list[str] = []

        async def body(
            run: stopline.Run,
            started: Started,
            provider: FakeProvider = provider,
            go: anyio.Event = go,
            child_ids: list[str] = child_ids,
        ) -> None:
            async def child_loop(n: int) -> None:
                async with run.child(f"c{n}") as child:
                    child_ids.append(child.id)
                    for i in range(50):
                        await child.call(provider.tool, i)
                        if i == 2:
                            go.set()

            async with anyio.create_task_group() as tg:
                for n in range(10):
                    tg.start_soon(child_loop, n)

        async with anyio.create_task_group() as tg:
            started = start(tg, ledger, body)
            await go.wait()
            await ledger.cancel(started.run_id, by="user:1")
        for child_id in child_ids:
            events = await ledger.backend.events(child_id)
            cancel = next(e.seq for e in events if e.kind == "cancel")
            assert all(e.seq < cancel for e in events if e.kind == "gate_passed")
        passed: set[str] = set()
        for child_id in child_ids:
            passed |= {
                e.op_id or ""
                for e in await ledger.backend.events(child_id)
                if e.kind == "gate_passed"
            }
        assert set(provider.requests) <= passed  # nothing reached it without the gate
        for child_id in child_ids:  # a call that passed but never left: not_committed
            for op in await ledger.backend.operations(child_id):
                if op.id in passed and op.id not in provider.requests:
                    assert op.status is OpStatus.NOT_COMMITTED


async def test_r11_another_tenant_can_neither_see_nor_cancel(ledger: stopline.Ledger) -> None:
    outsider = Principal("user:9", tenant="globex", roles=frozenset({"admin"}))
    neighbour = Principal("user:8", tenant="default")
    async with ledger.run("job", owner="user:1", tenant="default") as run:
        with pytest.raises(UnknownRun):
            await ledger.cancel(run.id, by=outsider)
        with pytest.raises(NotPermitted, match="may not cancel"):
            await ledger.cancel(run.id, by=neighbour)
        with pytest.raises(NotPermitted):
            await ledger.pause(run.id, by=neighbour)
        assert (await ledger.backend.get_run(run.id)).state is RunState.RUNNING
        admin = Principal("user:7", tenant="default", roles=frozenset({"admin"}))
        await ledger.cancel(run.id, by=admin)
    denied = [e for e in await ledger.backend.events(run.id) if e.kind == "denied"]
    assert [(e.data["principal"], e.data["action"]) for e in denied] == [
        ("user:9", "cancel"),
        ("user:8", "cancel"),
        ("user:8", "pause"),
    ]
    cancel = next(e for e in await ledger.backend.events(run.id) if e.kind == "cancel")
    assert cancel.data["by"] == "user:7"  # the allowed action is on the trail too


async def test_r10_approvals_that_expired_during_a_pause_are_asked_again(
    ledger: stopline.Ledger,
) -> None:
    pay = FakeProvider("pay")
    async with ledger.run("job", owner="user:1") as run:
        approval = await run.request_approval("pay", approver="manager:1")
        await ledger.approve(approval.id, by="manager:1", ttl=0)  # expires at once
        await ledger.pause(run.id, by="user:1")
        resumed = await ledger.resume(run.id, by="user:1")
        assert resumed.expired_approvals == (approval.id,)
        (record,) = await ledger.backend.approvals(run.id)
        assert record.status is ApprovalStatus.EXPIRED
        with pytest.raises(ApprovalNeeded, match="expired"):
            await run.call(pay.tool, 5, key="pay", needs_approval=True)
        again = await run.request_approval("pay", approver="manager:1")
        await ledger.approve(again.id, by="manager:1")
        await run.call(pay.tool, 5, key="pay", needs_approval=True)
    assert pay.effects == [f"{run.id}/pay"]


async def test_r11_reads_hide_other_tenants_runs(ledger: stopline.Ledger) -> None:
    async with ledger.run("job", owner="user:1", tenant="acme") as run:
        pass
    assert (await ledger.receipt(run.id, by=Principal("u", tenant="acme"))).run_id == run.id
    with pytest.raises(UnknownRun):
        await ledger.receipt(run.id, by=Principal("u", tenant="globex"))


async def test_r09_a_workflow_that_ends_while_pausing_completes(ledger: stopline.Ledger) -> None:
    """Found by the explorer: a pause during the last step must not strand the run."""
    last = FakeProvider("last", cancellable=Cancellable.NEVER)
    held = last.hold("accepted")

    async def body(run: stopline.Run, started: Started) -> None:
        await run.call(last.tool, "final")

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await held.reached.wait()
        await ledger.pause(started.run_id, by="user:1")
        held.release()
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.run_state is RunState.COMPLETED
    assert receipt.headline is Headline.COMPLETED


@pytest.mark.parametrize("decision", ["denied", "pending", "expired"])
async def test_r11_a_retried_key_passes_the_gate_only_with_its_approval_granted(
    ledger: stopline.Ledger, decision: str
) -> None:
    """An operation that provably did not happen (here refused by its provider; in
    LangGraph, the attempt an ``interrupt()`` stopped) is retried under its key with
    ``needs_approval``: the retry passed the gate whatever its approval said, and a
    denied wire was sent."""
    sent: list[int] = []
    refuse = True

    async def wire(amount: int) -> str:
        if refuse:
            raise stopline.Rejected("not now")  # nothing done
        sent.append(amount)
        return "wired"

    tool = stopline.Tool(wire)
    async with ledger.run("pay", owner="user:1", run_id="r") as run:
        with pytest.raises(stopline.Rejected):
            await run.call(tool, 500, key="w")
        refuse = False
        approval = await run.request_approval("w", approver="boss:1")
        if decision == "denied":
            await ledger.deny(approval.id, by="boss:1")
        elif decision == "expired":
            await ledger.approve(approval.id, by="boss:1", ttl=0)
        with pytest.raises(
            ApprovalNeeded, match=decision.rstrip("d") if decision != "pending" else decision
        ):
            await run.call(tool, 500, key="w", needs_approval=True)
        assert not sent
        assert (await ledger.backend.get_operation("r/w")).status is OpStatus.NOT_COMMITTED
        if decision == "pending":  # granted, the same retry passes
            await ledger.approve(approval.id, by="boss:1")
            assert await run.call(tool, 500, key="w", needs_approval=True) == "wired"
            assert sent == [500]


async def test_a_receipt_names_a_cancel_only_while_the_run_is_in_its_state(
    ledger: stopline.Ledger,
) -> None:
    """Cancelled, then resumed, then paused: the receipt said "cancelled by user:ada
    (wrong list)" under "Paused.", as if the old cancel were why. Who cancelled a run
    is on its receipt while its state is the cancel's; after a resume it is history
    (the event log keeps it)."""
    run_id = "run_history"
    async with ledger.run("mail", owner="user:ada", run_id=run_id):
        pass
    async with anyio.create_task_group() as tg:
        ready = anyio.Event()

        async def live() -> None:
            async with ledger.run("mail", owner="user:ada", run_id="run_live"):
                ready.set()
                await anyio.sleep_forever()

        tg.start_soon(live)
        await ready.wait()
        cancelled = await ledger.cancel("run_live", by="user:ada", reason="wrong list")
    assert (cancelled.cancelled_by, cancelled.cancel_reason) == ("user:ada", "wrong list")
    settled = await ledger.wait_settled("run_live", timeout=10)
    assert settled.cancelled_by == "user:ada"
    await ledger.resume("run_live", by="user:ada")
    resumed = await ledger.receipt("run_live")
    assert resumed.run_state is RunState.RUNNING
    assert (resumed.cancelled_by, resumed.cancel_reason) == (None, None)
    paused = await ledger.pause("run_live", by="user:ada")
    assert paused.headline is Headline.PAUSED
    assert (paused.cancelled_by, paused.cancel_reason) == (None, None)
    kinds = [e.kind for e in await ledger.backend.events("run_live")]
    assert "cancel" in kinds  # the history stays
    assert (await ledger.receipt(run_id)).cancelled_by is None
