"""Ledger contract for the lifecycle: subtree fences, ownership, pause, approvals, checkpoints."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest

from stopline.domain.lifecycle import ApprovalStatus
from stopline.domain.model import EventRecord
from stopline.domain.vocab import Grant, OpEvent, OpStatus, RunEvent, RunState
from stopline.errors import IllegalTransition, NotFound, NotPermitted
from stopline.ledger.backend import Backend, GateVerdict, OutcomeUpdate
from tests.ledger.contract import COMMIT, op_spec, run_spec, unmarked


class LifecycleContract:
    async def test_cancel_fences_the_exclusive_subtree_in_one_transaction(
        self, backend: Backend
    ) -> None:
        await backend.create_run(run_spec("root"))
        await backend.create_run(run_spec("child", parent_id="root"))
        await backend.create_run(run_spec("grandchild", parent_id="child"))
        await backend.create_run(run_spec("other"))
        result = await backend.cancel("root", by="u", reason="stop")
        assert result.first and set(result.fenced) == {"root", "child", "grandchild"}
        for run_id in result.fenced:
            run = await backend.get_run(run_id)
            assert run.state is RunState.CANCELLING and not run.grants & Grant.INITIATE
        assert (await backend.get_run("other")).state is RunState.RUNNING
        seqs = {
            e.run_id: e.seq
            for r in result.fenced
            for e in await backend.events(r)
            if e.kind == "cancel"
        }
        assert len(seqs) == 3
        again = await backend.cancel("root", by="u")
        assert not again.first and again.fenced == ()

    async def test_shared_child_survives_one_owner(self, backend: Backend) -> None:
        await backend.create_run(run_spec("a"))
        await backend.create_run(run_spec("b"))
        await backend.create_run(run_spec("refresh", parent_id="a", shared=True))
        await backend.add_owner("refresh", "b", exclusive=False, by="u")
        first = await backend.cancel("a", by="u")
        assert "refresh" not in first.fenced and first.released == ("refresh",)
        assert (await backend.get_run("refresh")).state is RunState.RUNNING
        assert (await backend.gate(op_spec("refresh/1", "refresh"))).verdict is GateVerdict.PASSED
        last = await backend.cancel("b", by="u")
        assert "refresh" in last.fenced  # its last owner is gone

    async def test_children_race_the_subtree_fence(self, backend: Backend) -> None:
        """R1 across a tree: no child dispatch lands after its root's cancel."""
        await _gates_racing(backend, functools.partial(backend.cancel, "root", by="u"))
        for n in range(5):
            events = await backend.events(f"c{n}")
            cancel = next(e.seq for e in events if e.kind == "cancel")
            assert all(e.seq < cancel for e in events if e.kind == "gate_passed")
            assert all(e.seq > cancel for e in events if e.kind == "gate_refused")

    async def test_pause_waits_then_resume(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec())
        assert await backend.pause("run_a", by="u") == ["run_a"]
        assert (await backend.get_run("run_a")).state is RunState.PAUSING  # one in flight
        paused = await backend.gate(op_spec("run_a/2"))
        assert paused.verdict is GateVerdict.PAUSED  # nothing recorded
        await backend.record("run_a/1:send", COMMIT)
        assert (await backend.settle_pause("run_a")).state is RunState.PAUSED
        run, expired = await backend.resume("run_a", by="u")
        assert run.state is RunState.RUNNING and expired == []
        assert (await backend.gate(op_spec("run_a/2"))).verdict is GateVerdict.PASSED

    async def test_a_retry_waits_at_a_paused_runs_gate_as_a_first_attempt_does(
        self, backend: Backend
    ) -> None:
        """R9 in the ledger, for every caller of the gate (the runtime, the engines): a
        key that provably took no effect is retried under a pause: ``PAUSED``, nothing
        recorded; after the resume it passes."""
        await backend.create_run(run_spec())
        await backend.gate(op_spec())
        await backend.record("run_a/1:send", OutcomeUpdate(OpEvent.REJECTED, []))
        assert await backend.pause("run_a", by="u") == ["run_a"]
        before = await backend.events("run_a")
        again = await backend.gate(op_spec())
        assert again.verdict is GateVerdict.PAUSED and again.operation is None
        assert await backend.events("run_a") == before  # nothing recorded
        assert (await backend.get_run("run_a")).state is RunState.PAUSED
        op = await backend.get_operation("run_a/1:send")
        assert op.status is OpStatus.NOT_COMMITTED and op.attempts == 1
        await backend.resume("run_a", by="u")
        assert (await backend.gate(op_spec())).verdict is GateVerdict.PASSED

    async def test_get_runs_reads_the_runs_there_by_id(self, backend: Backend) -> None:
        """The one read of the paused runs that calls wait on: the runs that exist, by
        id, each as ``get_run`` reads it; an id with no run is left out."""
        await backend.create_run(run_spec())
        await backend.create_run(run_spec("run_b"))
        await backend.pause("run_b", by="u")
        found = await backend.get_runs(["run_b", "run_missing", "run_a"])
        assert set(found) == {"run_a", "run_b"}
        assert found["run_a"] == await backend.get_run("run_a")
        assert found["run_b"].state.paused and not found["run_a"].state.paused
        assert await backend.get_runs([]) == {}

    async def test_the_change_mark_moves_with_every_commit(self, backend: Backend) -> None:
        """What ``wait_settled`` compares before reading a receipt again: a commit moves
        it (a run created, an intent, an outcome); a read does not."""
        first = await backend.change_mark()
        await backend.create_run(run_spec())
        after_run = await backend.change_mark()
        await backend.gate(op_spec())
        after_intent = await backend.change_mark()
        await backend.record("run_a/1:send", COMMIT)
        after_outcome = await backend.change_mark()
        assert len({first, after_run, after_intent, after_outcome}) == 4
        await backend.get_run("run_a")  # a read commits nothing
        assert await backend.change_mark() == after_outcome

    async def test_resume_after_cancel_needs_every_operation_resolved(
        self, backend: Backend
    ) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec())
        await backend.cancel("run_a", by="u")
        await backend.record("run_a/1:send", OutcomeUpdate(OpEvent.LOST, []))
        await backend.run_event("run_a", RunEvent.SETTLE, by="stopline")
        with pytest.raises(IllegalTransition):
            await backend.resume("run_a", by="u")  # settling: not yet
        await backend.record("run_a/1:send", OutcomeUpdate(OpEvent.VERIFIED_COMMITTED, []))
        await backend.run_event("run_a", RunEvent.SETTLED, by="stopline")
        run, _ = await backend.resume("run_a", by="u")
        assert run.state is RunState.RUNNING and run.grants & Grant.INITIATE

    async def test_resume_refused_while_an_operation_is_in_doubt(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec())
        await backend.record("run_a/1:send", OutcomeUpdate(OpEvent.LOST, []))
        await backend.run_event("run_a", RunEvent.ESCALATE, by="stopline")
        await backend.record("run_a/1:send", OutcomeUpdate(OpEvent.ESCALATED, []))
        with pytest.raises(IllegalTransition):
            await backend.resume("run_a", by="u")

    async def test_approval_gates_the_operation(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        spec = dataclasses.replace(op_spec("run_a/pay"), needs_approval=True)
        assert (await backend.gate(spec)).verdict is GateVerdict.NEEDS_APPROVAL
        approval = await backend.request_approval(
            "ap1", "run_a", "run_a/pay", approver="boss", requested_by="user:1"
        )
        assert approval.status is ApprovalStatus.PENDING
        assert (await backend.gate(spec)).verdict is GateVerdict.NEEDS_APPROVAL
        expired = await backend.decide_approval(
            "ap1", granted=True, by="boss", expires_at=time.time() - 1
        )
        assert not expired.valid_at(time.time())
        assert (await backend.gate(spec)).verdict is GateVerdict.NEEDS_APPROVAL
        await backend.request_approval(
            "ap2", "run_a", "run_a/pay", approver="boss", requested_by="user:1"
        )
        await backend.decide_approval("ap2", granted=True, by="boss", expires_at=None)
        assert (await backend.gate(spec)).verdict is GateVerdict.PASSED
        with pytest.raises(IllegalTransition):
            await backend.decide_approval("ap2", granted=False, by="boss", expires_at=None)
        with pytest.raises(NotFound):
            await backend.decide_approval("nope", granted=True, by="b", expires_at=None)

    async def test_cancel_withdraws_approvals(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.request_approval(
            "ap1", "run_a", "run_a/pay", approver="boss", requested_by="u"
        )
        await backend.cancel("run_a", by="u")
        (approval,) = await backend.approvals("run_a")
        assert approval.status is ApprovalStatus.WITHDRAWN

    async def test_a_tree_cancel_withdraws_the_approvals_of_the_runs_it_fences(
        self, backend: Backend
    ) -> None:
        """Only those: a shared child another owner still holds keeps its approval, as
        do a run outside the tree and a child that had ended (the fence passes it
        over), and a decided approval keeps its decision."""
        await backend.create_run(run_spec("root"))
        await backend.create_run(run_spec("child", parent_id="root"))
        await backend.create_run(run_spec("grandchild", parent_id="child"))
        await backend.create_run(run_spec("done", parent_id="root"))
        await backend.create_run(run_spec("other"))
        await backend.create_run(run_spec("shared", parent_id="root", shared=True))
        await backend.add_owner("shared", "other", exclusive=False, by="u")
        asked = {
            "root": "ap_root",
            "grandchild": "ap_gc",
            "done": "ap_done",
            "shared": "ap_sh",
            "other": "ap_ot",
        }
        for run_id, approval_id in asked.items():
            await backend.request_approval(
                approval_id, run_id, f"{run_id}/pay", approver="boss", requested_by="u"
            )
        await backend.request_approval(
            "ap_child", "child", "child/pay", approver="boss", requested_by="u"
        )
        await backend.decide_approval("ap_child", granted=False, by="boss", expires_at=None)
        await backend.run_event("done", RunEvent.COMPLETE, by="u")
        result = await backend.cancel("root", by="u")
        assert set(result.fenced) == {"root", "child", "grandchild"}
        status = {
            a.id: a.status for run_id in [*asked, "child"] for a in await backend.approvals(run_id)
        }
        assert status == {
            "ap_root": ApprovalStatus.WITHDRAWN,
            "ap_gc": ApprovalStatus.WITHDRAWN,
            "ap_child": ApprovalStatus.DENIED,
            "ap_done": ApprovalStatus.PENDING,
            "ap_sh": ApprovalStatus.PENDING,
            "ap_ot": ApprovalStatus.PENDING,
        }
        again = await backend.cancel("other", by="u")  # its shared child goes with it now
        assert set(again.fenced) == {"other", "shared"}
        assert {a.status for r in ("other", "shared") for a in await backend.approvals(r)} == {
            ApprovalStatus.WITHDRAWN
        }

    async def test_checkpoint_only_when_resolved(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        assert await backend.last_checkpoint("run_a") is None
        await backend.gate(op_spec())
        with pytest.raises(NotPermitted, match="not resolved"):
            await backend.checkpoint("run_a", "after-send", {"step": 1})
        await backend.record("run_a/1:send", COMMIT)
        first = await backend.checkpoint("run_a", "after-send", {"step": 1})
        assert first.seq == 1 and first.operations == ("run_a/1:send",)
        last = await backend.last_checkpoint("run_a")
        assert last is not None and last.state == {"step": 1}
        assert last.operations == ("run_a/1:send",)

    async def test_audit_trail(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.audit(
            "run_a", principal="mallory", action="cancel", allowed=False, detail="other tenant"
        )
        event = (await backend.events("run_a"))[-1]
        assert event.kind == "denied" and event.data["principal"] == "mallory"

    async def test_descendant_operations(self, backend: Backend) -> None:
        await backend.create_run(run_spec("root"))
        await backend.create_run(run_spec("child", parent_id="root"))
        await backend.gate(op_spec("root/1", "root"))
        await backend.gate(op_spec("child/1", "child"))
        mine = await backend.operations("root")
        tree = await backend.operations("root", descendants=True)
        assert [o.id for o in mine] == ["root/1"]
        assert {o.id for o in tree} == {"root/1", "child/1"}
        assert {o.status for o in tree} == {OpStatus.REQUESTED}
        run, together = await backend.run_and_operations("root", descendants=True)
        assert run == await backend.get_run("root") and together == tree

    async def test_resume_of_a_running_or_ended_run_changes_nothing(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        run, expired = await backend.resume("run_a", by="u")
        assert run.state is RunState.RUNNING and expired == []
        await backend.run_event("run_a", RunEvent.COMPLETE, by="u")
        before = await backend.events("run_a")
        run, _ = await backend.resume("run_a", by="u")
        assert run.state is RunState.COMPLETED
        assert await backend.events("run_a") == before

    async def test_a_tree_pause_and_resume_move_each_run_with_its_own_events(
        self, backend: Backend
    ) -> None:
        """A pause and a resume of a tree are set-based (one statement per step, whatever
        its size): each run still gets its own events in order and its own state, an idle
        run paused at once and a busy one left pausing; a run that ended, and a shared
        child, are not moved; each run's resume names its own expired approvals."""
        await backend.create_run(run_spec("root"))
        for child in ("busy", "idle", "done"):
            await backend.create_run(run_spec(child, parent_id="root"))
        await backend.create_run(run_spec("grand", parent_id="idle"))
        await backend.create_run(run_spec("other"))
        await backend.create_run(run_spec("shared", parent_id="other"))
        await backend.add_owner("shared", "root", exclusive=False, by="u")
        await backend.gate(op_spec("busy/1:send", "busy"))  # in flight
        await backend.run_event("done", RunEvent.COMPLETE, by="stopline")
        await backend.request_approval("ap1", "grand", "grand/pay", approver="b", requested_by="u")
        await backend.decide_approval("ap1", granted=True, by="b", expires_at=time.time() - 1)

        paused = await backend.pause("root", by="u", reason="lunch")
        assert paused == ["root", "busy", "idle", "grand"]  # the closure's order
        states = {r: (await backend.get_run(r)).state for r in (*paused, "done", "shared")}
        assert states == {
            "root": RunState.PAUSED,
            "busy": RunState.PAUSING,  # its call is in flight
            "idle": RunState.PAUSED,
            "grand": RunState.PAUSED,
            "done": RunState.COMPLETED,
            "shared": RunState.RUNNING,  # another owner holds it
        }

        def moves(events: list[EventRecord]) -> list[tuple[str, str | None, str | None]]:
            return [(e.kind, e.from_state, e.to_state) for e in events if e.op_id is None]

        assert moves(await backend.events("idle"))[-2:] == [
            ("pause", "running", "pausing"),
            ("paused", "pausing", "paused"),
        ]
        assert moves(await backend.events("busy"))[-1] == ("pause", "running", "pausing")
        pause = [e for e in await backend.events("grand") if e.kind == "pause"]
        assert unmarked(pause[0].data) == {"by": "u", "reason": "lunch"}

        root, expired = await backend.resume("root", by="u2")
        assert root.state is RunState.RUNNING and expired == ["ap1"]
        for rid, was in (("root", "paused"), ("busy", "pausing"), ("grand", "paused")):
            run = await backend.get_run(rid)
            assert run.state is RunState.RUNNING and run.grants & Grant.INITIATE
            (resume,) = [e for e in await backend.events(rid) if e.kind == "resume"]
            assert (resume.from_state, resume.to_state) == (was, "running")
            named = ["ap1"] if rid == "grand" else []
            assert unmarked(resume.data) == {"by": "u2", "expired_approvals": named}
        assert (await backend.get_run("done")).state is RunState.COMPLETED
        assert (await backend.approvals("grand"))[0].status is ApprovalStatus.EXPIRED

    async def test_children_race_the_tree_pause(self, backend: Backend) -> None:
        """Gates of a tree's runs racing its pause: each lands before the pause (and its
        run is left pausing while the call is in flight) or after it (refused, nothing
        recorded); a run paused at once has nothing in flight."""
        await _gates_racing(backend, functools.partial(backend.pause, "root", by="u"))
        for n in range(5):
            events = await backend.events(f"c{n}")
            pause = next(e.seq for e in events if e.kind == "pause")
            passed = [e.seq for e in events if e.kind == "gate_passed"]
            assert all(seq < pause for seq in passed)
            state = (await backend.get_run(f"c{n}")).state
            assert state is (RunState.PAUSING if passed else RunState.PAUSED)


async def _gates_racing(backend: Backend, stop: Callable[[], Coroutine[Any, Any, Any]]) -> None:
    """A root with five children, each dispatching 20 calls, and ``stop`` of the root
    started among them (after the eleventh round)."""
    await backend.create_run(run_spec("root"))
    for n in range(5):
        await backend.create_run(run_spec(f"c{n}", parent_id="root"))

    async def dispatch(n: int, i: int) -> None:
        await backend.gate(op_spec(f"c{n}/{i}", f"c{n}"))

    async with anyio.create_task_group() as tg:
        for i in range(20):
            for n in range(5):
                tg.start_soon(dispatch, n, i)
            if i == 10:
                tg.start_soon(stop)
