"""The ledger contract: what every backend must do, written once.

A backend's test module subclasses ``LedgerContract`` and provides a
``backend`` fixture; the tests below then run unchanged against it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import pytest

from stopline.domain.model import Evidence, OperationRecord, OperationSpec
from stopline.domain.vocab import (
    Cancellable,
    Cause,
    Grant,
    OpEvent,
    OpStatus,
    PhaseKind,
    Policy,
    RunEvent,
    RunState,
)
from stopline.errors import (
    IdempotencyConflict,
    IllegalTransition,
    InvalidInput,
    UnknownOperation,
    UnknownRun,
)
from stopline.ledger.backend import Backend, GateVerdict, Note, OutcomeUpdate, RunSpec


def run_spec(run_id: str = "run_a", **kw: object) -> RunSpec:
    return RunSpec(id=run_id, name="job", owner="user:1", tenant="acme", **kw)  # type: ignore[arg-type]


def unmarked(data: Mapping[str, Any]) -> dict[str, Any]:
    """An event's data without its write attempt's mark (``attempt``)."""
    return {key: value for key, value in data.items() if key != "attempt"}


def op_spec(
    op_id: str = "run_a/1:send", run_id: str = "run_a", digest: str = "d1"
) -> OperationSpec:
    return OperationSpec(
        id=op_id,
        run_id=run_id,
        tool="send",
        args_digest=digest,
        description="send",
        cancellable=Cancellable.UNTIL_ACCEPTED,
        can_verify=True,
        can_compensate=False,
    )


COMMIT = OutcomeUpdate(
    OpEvent.COMMITTED, [Evidence.local("response")], result={"ok": 1}, has_result=True
)


class LedgerContract:
    async def test_create_and_read_run(self, backend: Backend) -> None:
        run = await backend.create_run(run_spec())
        assert run.state is RunState.RUNNING
        assert run.grants == Grant.all()
        assert (await backend.get_run("run_a")) == run
        assert [r.id for r in await backend.list_runs(owner="user:1")] == ["run_a"]
        assert await backend.list_runs(state=RunState.CANCELLED) == []

    async def test_gate_records_intent(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        result = await backend.gate(op_spec())
        assert result.verdict is GateVerdict.PASSED
        op = await backend.get_operation("run_a/1:send")
        assert op.status is OpStatus.REQUESTED
        assert [e.kind for e in await backend.events("run_a")] == ["run_created", "gate_passed"]

    async def test_gate_refuses_after_fence(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        run, first = await backend.run_event("run_a", RunEvent.CANCEL, by="user:1", reason="r")
        assert first and run.state is RunState.CANCELLING
        assert not run.grants & Grant.INITIATE  # cancel revokes initiate, keeps the rest
        assert run.grants & Grant.VERIFY and run.grants & Grant.AUDIT
        result = await backend.gate(op_spec())
        assert result.verdict is GateVerdict.PREVENTED
        assert result.operation is not None
        assert result.operation.status is OpStatus.PREVENTED

    async def test_cancel_is_idempotent(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        first, changed = await backend.run_event("run_a", RunEvent.CANCEL, by="a", reason="one")
        second, again = await backend.run_event("run_a", RunEvent.CANCEL, by="b", reason="two")
        assert changed and not again
        assert second.fence == first.fence == 1
        assert second.cancelled_by == "a" and second.cancel_reason == "one"  # first wins
        kinds = [e.kind for e in await backend.events("run_a")]
        assert kinds.count("cancel") == 1

    async def test_every_requested_precedes_the_cancel(self, backend: Backend) -> None:
        """R1 in ledger order, with gates racing a cancel."""
        await backend.create_run(run_spec())

        async def dispatch(i: int) -> None:
            await backend.gate(op_spec(f"run_a/{i}:send"))

        async with anyio.create_task_group() as tg:
            for i in range(40):
                tg.start_soon(dispatch, i)
                if i == 20:
                    tg.start_soon(
                        functools.partial(backend.run_event, "run_a", RunEvent.CANCEL, by="u")
                    )
        events = await backend.events("run_a")
        cancel_seq = next(e.seq for e in events if e.kind == "cancel")
        passed = [e.seq for e in events if e.kind == "gate_passed"]
        refused = [e.seq for e in events if e.kind == "gate_refused"]
        assert all(seq < cancel_seq for seq in passed)
        assert all(seq > cancel_seq for seq in refused)
        assert len(passed) + len(refused) == 40

    async def test_record_transitions_and_evidence(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec())
        accepted = await backend.record(
            "run_a/1:send", OutcomeUpdate(OpEvent.ACCEPTED, [Evidence.local("ack")])
        )
        assert accepted.status is OpStatus.ACCEPTED
        done = await backend.record("run_a/1:send", COMMIT)
        assert done.status is OpStatus.COMMITTED
        assert done.result == {"ok": 1} and done.has_result
        assert [e.ref for e in done.evidence] == ["gate", "ack", "response"]

    async def test_lost_records_cause(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec())
        op = await backend.record(
            "run_a/1:send",
            OutcomeUpdate(OpEvent.LOST, [Evidence.local("timeout")], cause=Cause.TIMEOUT),
        )
        assert op.status is OpStatus.UNKNOWN and op.cause is Cause.TIMEOUT
        assert [o.id for o in await backend.unresolved()] == ["run_a/1:send"]

    async def test_illegal_transition_changes_nothing(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec())
        await backend.record("run_a/1:send", COMMIT)
        before = await backend.events("run_a")
        with pytest.raises(IllegalTransition) as info:
            await backend.record("run_a/1:send", OutcomeUpdate(OpEvent.LOST, []))
        assert info.value.state is OpStatus.COMMITTED
        assert await backend.events("run_a") == before
        assert (await backend.get_operation("run_a/1:send")).status is OpStatus.COMMITTED

    async def test_id_reuse_with_other_arguments_is_refused(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec(digest="d1"))
        before = await backend.events("run_a")
        with pytest.raises(IdempotencyConflict):
            await backend.gate(op_spec(digest="d2"))
        assert await backend.events("run_a") == before

    async def test_same_id_same_arguments_returns_existing(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec())
        await backend.record("run_a/1:send", COMMIT)
        again = await backend.gate(op_spec())
        assert again.verdict is GateVerdict.EXISTING
        assert again.operation is not None and again.operation.result == {"ok": 1}

    async def test_retry_of_not_committed_keeps_the_id(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec())
        await backend.record("run_a/1:send", OutcomeUpdate(OpEvent.REJECTED, []))
        again = await backend.gate(op_spec())
        assert again.verdict is GateVerdict.PASSED
        op = await backend.get_operation("run_a/1:send")
        assert op.status is OpStatus.REQUESTED and op.attempts == 2

    async def test_unknown_ids(self, backend: Backend) -> None:
        with pytest.raises(UnknownRun):
            await backend.get_run("nope")
        with pytest.raises(UnknownRun):
            await backend.run_event("nope", RunEvent.CANCEL, by="u")
        with pytest.raises(UnknownRun):
            await backend.gate(op_spec(run_id="nope", op_id="nope/1"))
        with pytest.raises(UnknownOperation):
            await backend.get_operation("nope/1")
        with pytest.raises(UnknownOperation):
            await backend.record("nope/1", COMMIT)
        with pytest.raises(UnknownRun):
            await backend.operations("nope")

    async def test_run_transitions(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        run, _ = await backend.run_event("run_a", RunEvent.COMPLETE, by="u")
        assert run.state is RunState.COMPLETED
        assert run == await backend.get_run("run_a")  # as written, whole
        logged = await backend.events("run_a")
        assert [(e.kind, e.from_state, e.to_state) for e in logged[1:]] == [
            ("complete", "running", "completed")
        ]
        with pytest.raises(IllegalTransition):
            await backend.run_event("run_a", RunEvent.PAUSE, by="u")
        assert await backend.events("run_a") == logged  # an illegal move writes nothing
        with pytest.raises(UnknownRun):
            await backend.run_event("nobody", RunEvent.COMPLETE, by="u")
        _, changed = await backend.run_event("run_a", RunEvent.CANCEL, by="u")
        assert not changed  # cancelling a finished run changes nothing (R7)

    async def test_a_phase_is_written_with_its_event_and_an_unknown_run_gets_none(
        self, backend: Backend
    ) -> None:
        await backend.create_run(run_spec())
        run = await backend.set_phase("run_a", PhaseKind.COMMITTING, Policy.VERIFY)
        assert (run.phase, run.policy) == (PhaseKind.COMMITTING, Policy.VERIFY)
        assert run == await backend.get_run("run_a")  # as written, whole
        phases = [e.data for e in await backend.events("run_a") if e.kind == "phase"]
        # PostgreSQL marks the attempt, to read back after a lost reply (deployment.md)
        assert [unmarked(data) for data in phases] == [{"phase": "committing", "policy": "verify"}]
        with pytest.raises(UnknownRun):
            await backend.set_phase("nobody", PhaseKind.COMMITTING, Policy.VERIFY)
        with pytest.raises(UnknownRun):  # and it was not created by the change
            await backend.get_run("nobody")

    async def test_child_of_fenced_parent_is_born_fenced(self, backend: Backend) -> None:
        await backend.create_run(run_spec("parent"))
        await backend.run_event("parent", RunEvent.CANCEL, by="u")
        child = await backend.create_run(run_spec("child", parent_id="parent"))
        assert not child.grants & Grant.INITIATE
        assert child.grants == Grant.all() & ~Grant.INITIATE  # the others kept
        assert child.state is RunState.CANCELLING and child.parent_id == "parent"
        assert child == await backend.get_run("child")  # as written, whole
        created = (await backend.events("child"))[0]
        assert (created.kind, created.to_state) == ("run_created", "cancelling")
        gate = await backend.gate(op_spec("child/1", run_id="child"))
        assert gate.verdict is GateVerdict.PREVENTED

    async def test_a_child_of_a_live_parent_runs_and_is_linked(self, backend: Backend) -> None:
        await backend.create_run(run_spec("parent"))
        child = await backend.create_run(run_spec("child", parent_id="parent"))
        assert child.state is RunState.RUNNING and child.parent_id == "parent"
        assert child == await backend.get_run("child")
        created = (await backend.events("child"))[0]
        assert (created.kind, created.to_state) == ("run_created", "running")
        assert created.data == {"owner": "user:1", "tenant": "acme", "parent": "parent"}
        assert (await backend.cancel("parent", by="u")).fenced == ("parent", "child")

    async def test_a_child_of_no_parent_is_unknown_run_and_writes_nothing(
        self, backend: Backend
    ) -> None:
        with pytest.raises(UnknownRun) as info:
            await backend.create_run(run_spec("orphan", parent_id="nobody"))
        assert info.value.run_id == "nobody"
        with pytest.raises(UnknownRun):
            await backend.get_run("orphan")

    async def test_note_keeps_status(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec())
        op = await backend.note("run_a/1:send", "progress", {"progress": 0.5}, cancel_state="asked")
        assert op.status is OpStatus.REQUESTED and op.cancel_state == "asked"
        assert op == await backend.get_operation("run_a/1:send")  # as written, whole
        last = (await backend.events("run_a"))[-1]
        assert (last.kind, last.op_id, last.data) == ("progress", "run_a/1:send", {"progress": 0.5})
        assert (last.from_state, last.to_state) == ("requested", "requested")
        plain = await backend.note("run_a/1:send", "late_copy", {"n": 1})  # no cancel state
        assert plain == await backend.get_operation("run_a/1:send") == op
        logged = await backend.events("run_a")
        with pytest.raises(UnknownOperation):
            await backend.note("run_a/9:nothing", "progress", {}, cancel_state="asked")
        assert await backend.events("run_a") == logged  # nothing written for it

    async def test_note_many_writes_each_and_returns_an_unknown_operation(
        self, backend: Backend
    ) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec())
        await backend.gate(op_spec("run_a/2:send", digest="d2"))
        notes = [
            Note("run_a/1:send", "cancel_not_asked", {"n": 1}, cancel_state="not_asked"),
            Note("run_a/9:nothing", "cancel_not_asked", {"n": 9}),
            Note("run_a/2:send", "cancel_not_supported", {"n": 2}, cancel_state="not_supported"),
        ]
        first, missing, second = await backend.note_many(notes)
        assert isinstance(missing, UnknownOperation)
        assert isinstance(first, OperationRecord) and isinstance(second, OperationRecord)
        assert (first.status, first.cancel_state) == (OpStatus.REQUESTED, "not_asked")
        assert (second.status, second.cancel_state) == (OpStatus.REQUESTED, "not_supported")
        events = [(e.kind, e.data) for e in (await backend.events("run_a"))[-2:]]
        assert events == [("cancel_not_asked", {"n": 1}), ("cancel_not_supported", {"n": 2})]

    async def test_note_many_is_note_one_by_one(self, backend: Backend) -> None:
        """The set-based ``note_many`` (a tree's provider answers) writes and logs exactly
        what ``note`` does note by note."""
        notes: list[tuple[str, str, dict[str, Any], str | None]] = [
            ("2", "cancel_not_supported", {"n": 2}, "not_supported"),
            ("1", "cancel_asked", {"n": 1, "channel": "x"}, "asked"),  # in the order asked
            ("3", "progress", {"progress": 0.5}, None),  # no cancel state: none set
            ("1", "cancel_confirmed", {"n": 11}, "confirmed"),  # named twice: in order
            ("9", "progress", {}, None),  # unknown: in its place
            ("4", "cancel_not_asked", {"n": 4}, "not_asked"),
        ]
        results = {}
        for run_id in ("run_many", "run_each"):
            await backend.create_run(run_spec(run_id))
            for n in range(1, 5):
                await backend.gate(op_spec(f"{run_id}/{n}", run_id, digest=f"d{n}"))
            await backend.record(f"{run_id}/4", COMMIT)
            items = [Note(f"{run_id}/{n}", kind, data, state) for n, kind, data, state in notes]
            if run_id == "run_many":
                got = await backend.note_many(items)
            else:  # the seam's own default: ``note`` note by note
                got = await Backend.note_many(backend, items)
            results[run_id] = (
                [
                    type(r).__name__ if isinstance(r, Exception) else (r.status, r.cancel_state)
                    for r in got
                ],
                [
                    (e.op_id and e.op_id.split("/")[1], e.kind, e.from_state, e.to_state, e.data)
                    for e in await backend.events(run_id)
                    if e.op_id and e.kind not in ("gate_passed", "committed")
                ],
            )
        assert results["run_many"] == results["run_each"]
        assert results["run_many"][0][4] == "UnknownOperation"
        assert results["run_many"][0][3] == (OpStatus.REQUESTED, "confirmed")

    async def test_record_many_is_record_one_by_one(self, backend: Backend) -> None:
        """The set-based ``record_many`` (a tree's interrupted calls) moves, refuses and
        logs exactly what ``record`` does call by call: the same rule, one spelling."""
        lost = OutcomeUpdate(
            OpEvent.LOST,
            [Evidence.local("user_cancel", "interrupted"), Evidence.local("horizon", "9.5")],
            cause=Cause.USER_CANCEL,
        )
        updates = [
            ("2", lost),
            ("1", lost),  # logged in the order asked, not the ids'
            ("3", lost),  # committed already: refused
            ("1", lost),  # named twice: the second meets the first's outcome
            ("4", COMMIT),
            ("5", OutcomeUpdate(OpEvent.ACCEPTED, [], cancel_state="asked")),
            ("6", COMMIT),
            ("2", dataclasses.replace(COMMIT, late=True, error="late answer")),
        ]
        results = {}
        for run_id in ("run_many", "run_each"):
            await backend.create_run(run_spec(run_id))
            for n in range(1, 7):
                await backend.gate(op_spec(f"{run_id}/{n}", run_id, digest=f"d{n}"))
            await backend.record(f"{run_id}/3", COMMIT)
            items = [(f"{run_id}/{n}", update) for n, update in updates]
            if run_id == "run_many":
                got = await backend.record_many(items)
            else:
                got = []
                for op_id, update in items:
                    try:
                        got.append(await backend.record(op_id, update))
                    except IllegalTransition as exc:
                        got.append(exc)
            results[run_id] = (
                [_outcome(r) for r in got],
                [_outcome(op) for op in await backend.operations(run_id)],
                [
                    (e.op_id and e.op_id.split("/")[1], e.kind, e.from_state, e.to_state, data)
                    for e in await backend.events(run_id)
                    for data in [{k: v for k, v in e.data.items() if k != "attempt"}]
                ],
            )
        for many, each in zip(results["run_many"], results["run_each"], strict=True):
            assert many == each
        answers = results["run_many"][0]
        assert [a[0] for a in answers] == [
            "unknown", "unknown", "IllegalTransition", "IllegalTransition", "committed",
            "accepted", "committed", "committed",
        ]  # fmt: skip

    async def test_record_many_of_an_unknown_operation_writes_nothing(
        self, backend: Backend
    ) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec())
        await backend.gate(op_spec("run_a/2:send", digest="d2"))
        before = await backend.events("run_a")
        lost = OutcomeUpdate(OpEvent.LOST, [], cause=Cause.USER_CANCEL)
        items = [("run_a/1:send", lost), ("run_a/9:nothing", lost), ("run_a/2:send", lost)]
        with pytest.raises(UnknownOperation):
            await backend.record_many(items)
        assert await backend.events("run_a") == before
        ops = await backend.operations("run_a")
        assert [op.status for op in ops] == [OpStatus.REQUESTED] * 2

    async def test_run_and_operations_reads_both(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec())
        run, ops = await backend.run_and_operations("run_a")
        assert run == await backend.get_run("run_a")
        assert ops == await backend.operations("run_a")
        with pytest.raises(UnknownRun):
            await backend.run_and_operations("run_nothing")

    async def test_runs_and_operations_is_run_and_operations_run_by_run(
        self, backend: Backend
    ) -> None:
        """One read for many runs (a cancelled tree's settling): each run and its own
        operations, in the order asked, as ``run_and_operations`` reads them; an unknown
        run in its place."""
        for run_id in ("run_a", "run_b", "run_c"):
            await backend.create_run(run_spec(run_id))
        await backend.create_run(run_spec("run_d", parent_id="run_a"))
        await backend.gate(op_spec("run_a/2", "run_a", digest="d2"))
        await backend.gate(op_spec("run_a/1", "run_a", digest="d1"))
        await backend.gate(op_spec("run_d/1", "run_d"))
        await backend.gate(op_spec("run_c/1", "run_c"))
        await backend.record("run_c/1", COMMIT)
        asked = ["run_c", "run_nothing", "run_a", "run_b", "run_d", "run_a"]
        found = await backend.runs_and_operations(asked)
        for run_id, got in zip(asked, found, strict=True):
            if run_id == "run_nothing":
                assert isinstance(got, UnknownRun)
                continue
            assert got == await backend.run_and_operations(run_id)
        assert [op.id for op in found[2][1]] == ["run_a/2", "run_a/1"]  # type: ignore[index]
        assert _same(found, await Backend.runs_and_operations(backend, asked))  # the default
        assert await backend.runs_and_operations([]) == []

    async def test_trees_and_operations_is_each_trees_read_run_by_run(
        self, backend: Backend
    ) -> None:
        """One read of many receipts' runs (a page of them): each run with the operations
        of its tree (what it owns exclusively, at any depth; a shared child's are not
        in it), in the order asked and in a tree's read's order, as
        ``run_and_operations(descendants=True)`` reads them; an unknown run in its
        place. A run asked for beside its own root is read in both trees."""
        for run_id in ("root", "other"):
            await backend.create_run(run_spec(run_id))
        await backend.create_run(run_spec("child", parent_id="root"))
        await backend.create_run(run_spec("grandchild", parent_id="child"))
        await backend.create_run(run_spec("shared", parent_id="other", shared=True))
        await backend.add_owner("shared", "root", exclusive=False, by="u")
        for op_id, run_id in [
            ("grandchild/1", "grandchild"),
            ("root/1", "root"),
            ("shared/1", "shared"),
            ("child/1", "child"),
            ("root/2", "root"),
            ("other/1", "other"),
        ]:
            await backend.gate(op_spec(op_id, run_id, digest=op_id))
        await backend.record("child/1", COMMIT)
        asked = ["child", "run_nothing", "root", "shared", "other", "root", "grandchild"]
        found = await backend.trees_and_operations(asked)
        for run_id, got in zip(asked, found, strict=True):
            if run_id == "run_nothing":
                assert isinstance(got, UnknownRun)
                continue
            assert got == await backend.run_and_operations(run_id, descendants=True)
        tree = [op.id for op in found[2][1]]  # type: ignore[index]
        assert tree == ["grandchild/1", "root/1", "child/1", "root/2"]
        assert _same(found, await Backend.trees_and_operations(backend, asked))  # the default
        assert await backend.trees_and_operations([]) == []

    async def test_a_settling_read_leaves_out_what_a_step_does_not_read(
        self, backend: Backend
    ) -> None:
        """``settling``: a run's open operations, and its committed ones that can be
        compensated (not corrections); its other settled ones are left out, in order."""
        await backend.create_run(run_spec())
        lost = OutcomeUpdate(OpEvent.LOST, [Evidence.local("no answer")])
        plain = op_spec("run_a/1", digest="d1")
        undoable = dataclasses.replace(op_spec("run_a/2", digest="d2"), can_compensate=True)
        for spec in (
            plain,
            undoable,
            op_spec("run_a/3", digest="d3"),
            op_spec("run_a/4", digest="d4"),
        ):
            await backend.gate(spec)
        await backend.record("run_a/1", COMMIT)  # settled, nothing to undo: left out
        await backend.record("run_a/2", COMMIT)  # settled, may be compensated: kept
        await backend.record("run_a/3", lost)  # unknown: kept
        # run_a/4 is in flight (requested): kept
        ((run, ops),) = await backend.runs_and_operations(["run_a"], settling=True)  # type: ignore[misc]
        assert run == await backend.get_run("run_a")
        assert [op.id for op in ops] == ["run_a/2", "run_a/3", "run_a/4"]
        everything = await backend.runs_and_operations(["run_a"])
        assert [op.id for op in everything[0][1]] == ["run_a/1", "run_a/2", "run_a/3", "run_a/4"]  # type: ignore[index]

    async def test_get_operations_is_get_operation_one_by_one(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        await backend.gate(op_spec("run_a/1"))
        await backend.gate(op_spec("run_a/2", digest="d2"))
        await backend.record("run_a/2", COMMIT)
        asked = ["run_a/2", "run_a/9", "run_a/1", "run_a/2"]
        found = await backend.get_operations(asked)
        assert isinstance(found[1], UnknownOperation)
        assert [found[0], found[2], found[3]] == [
            await backend.get_operation(op_id) for op_id in ("run_a/2", "run_a/1", "run_a/2")
        ]
        assert _same(found, await Backend.get_operations(backend, asked))  # the default

    async def test_run_events_is_run_event_one_by_one(self, backend: Backend) -> None:
        """The set-based ``run_events`` (a tree's runs settling together) moves, refuses
        and logs exactly what ``run_event`` does run by run: the same table."""
        moves = [
            ("b", RunEvent.SETTLE),
            ("a", RunEvent.SETTLE),  # logged in the order asked, not the ids'
            ("c", RunEvent.SETTLED),  # running: refused
            ("a", RunEvent.SETTLED),  # named twice: the second meets the first's move
            ("nothing", RunEvent.SETTLE),  # unknown: in its place
            ("d", RunEvent.COMPLETE),
            ("b", RunEvent.ESCALATE),
        ]
        results = {}
        for side in ("many", "each"):
            for name in "abcd":
                await backend.create_run(run_spec(f"{side}_{name}"))
            for name in "ab":
                await backend.cancel(f"{side}_{name}", by="user:1")
            items = [(f"{side}_{name}", event) for name, event in moves]
            if side == "many":
                got = await backend.run_events(items, by="system")
                last = {r[0].id: r[0] for r in got if isinstance(r, tuple)}
                for run_id, run in last.items():  # each run as it was written, whole
                    assert run == await backend.get_run(run_id)
            else:  # the seam's own default: ``run_event`` run by run
                got = await Backend.run_events(backend, items, by="system")
            results[side] = (
                [_moved(r) for r in got],
                [
                    (e.kind, e.from_state, e.to_state, {**e.data, "root": ""})
                    for name in "abcd"
                    for e in await backend.events(f"{side}_{name}")
                    if e.kind != "run_created"
                ],
            )
        assert results["many"] == results["each"]
        assert [r[0] for r in results["many"][0]] == [
            "settling", "settling", "IllegalTransition", "cancelled", "UnknownRun", "completed",
            "needs_review",
        ]  # fmt: skip

    async def test_run_events_refuses_a_cancel_and_writes_nothing(self, backend: Backend) -> None:
        await backend.create_run(run_spec())
        before = await backend.events("run_a")
        with pytest.raises(InvalidInput, match="cancel"):
            await backend.run_events([("run_a", RunEvent.CANCEL)], by="user:1")
        assert await backend.events("run_a") == before
        assert (await backend.get_run("run_a")).state is RunState.RUNNING

    async def test_a_read_backs_verdict_moves_only_the_attempt_it_looked_for(
        self, backend: Backend
    ) -> None:
        """ADR 0099: a verdict naming attempt 1, written once attempt 2 has been sent and
        lost, is refused (``IllegalTransition``, alone or among many; nothing written);
        attempt 2's own verdict, or one naming no attempt (an answer), moves it."""
        await backend.create_run(run_spec())
        lost = OutcomeUpdate(OpEvent.LOST, [Evidence.local("no answer")])
        found = OutcomeUpdate(OpEvent.VERIFIED_NOT_COMMITTED, [Evidence.local("looked")], attempt=1)
        op_id, other = "run_a/1:send", "run_a/2:send"
        for attempt in (1, 2):
            for one in (op_id, other):
                await backend.gate(op_spec(one))
                await backend.record(one, lost)
                if attempt == 1:
                    assert (await backend.record(one, found)).status is OpStatus.NOT_COMMITTED
        assert (await backend.get_operation(op_id)).attempts == 2
        before = await backend.events("run_a")
        stale = OutcomeUpdate(OpEvent.VERIFIED_NOT_COMMITTED, [Evidence.local("old")], attempt=1)
        with pytest.raises(IllegalTransition):
            await backend.record(op_id, stale)
        for items in ([(op_id, stale)], [(op_id, stale), (other, stale)]):  # one; set-based
            refused = await backend.record_many(items)
            assert [type(r) for r in refused] == [IllegalTransition] * len(items)
            assert {r.state for r in refused if isinstance(r, IllegalTransition)} == {
                OpStatus.UNKNOWN
            }
        assert await backend.events("run_a") == before
        assert (await backend.get_operation(op_id)).status is OpStatus.UNKNOWN
        own = dataclasses.replace(stale, event=OpEvent.VERIFIED_COMMITTED, attempt=2)
        assert (await backend.record(op_id, own)).status is OpStatus.COMMITTED


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """The same answers, an error compared by its type and message."""

    def key(x: Any) -> Any:
        return (type(x).__name__, str(x)) if isinstance(x, Exception) else x

    return [key(x) for x in a] == [key(x) for x in b]


def _moved(result: Any) -> tuple[Any, ...]:
    """What a run transition (or its refusal) says, without the instant it was written."""
    if isinstance(result, Exception):
        return (type(result).__name__,)
    run, changed = result
    return (run.state.value, changed, run.id.split("_", 1)[1])


def _outcome(result: OperationRecord | IllegalTransition) -> tuple[Any, ...]:
    """What a record (or its refusal) says, without the instant it was written."""
    if isinstance(result, IllegalTransition):
        return (type(result).__name__, result.state)
    return (
        result.status.value, result.cause, result.error, result.result, result.has_result,
        result.cancel_state, [(e.kind, e.ref, e.detail) for e in result.evidence],
        result.attempts,
    )  # fmt: skip
