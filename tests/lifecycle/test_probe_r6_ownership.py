"""R6/R11 probe: odd ownership is refused, named, and writes nothing.

Before: ``ledger.share(run, with_owner=run)`` made a run its own owner (it could never
lose its last owner, so no owner's cancel fenced it); and ``ledger.run(...,
parent_id=...)`` without ``tenant=`` made a child of the default tenant under a run of
another: a principal of the default tenant read the child's receipt, and the parent's
receipt showed the operations of another tenant's run.
"""

from __future__ import annotations

import pytest

import stopline
from stopline import Principal, RunState
from stopline.errors import InvalidInput, NotPermitted, UnknownRun


async def test_a_run_cannot_own_itself(ledger: stopline.Ledger) -> None:
    async with ledger.run("refresh", owner="alice", run_id="self-owned") as run:
        before = await ledger.backend.events(run.id)
        with pytest.raises(InvalidInput, match=r"with_owner.*cannot own itself"):
            await ledger.share(run.id, with_owner=run.id, by="alice")
        assert await ledger.backend.events(run.id) == before
        await ledger.cancel(run.id, by="alice")


async def test_a_child_run_is_of_its_parents_tenant(ledger: stopline.Ledger) -> None:
    alice = Principal("alice", tenant="acme")
    async with ledger.run("job", owner="alice", tenant="acme", run_id="acme-parent") as parent:
        for tenant in ("default", "other"):
            with pytest.raises(InvalidInput, match="tenant"):
                async with ledger.run(
                    "sub", owner="alice", tenant=tenant, run_id="sub", parent_id=parent.id
                ):
                    pass
            with pytest.raises(UnknownRun):  # nothing was written
                await ledger.reads.run("sub")
        async with ledger.run(
            "sub", owner="alice", tenant="acme", run_id="sub", parent_id=parent.id
        ) as sub:
            assert sub.tenant == "acme"
            async with sub.child("deeper") as deeper:  # a child's child: its tenant too
                assert deeper.tenant == "acme"
        with pytest.raises(UnknownRun):  # no principal of another tenant sees it
            await ledger.receipt("sub", by="eve")
        await ledger.cancel(parent.id, by=alice)


async def test_a_run_cannot_be_owned_by_a_run_it_owns(ledger: stopline.Ledger) -> None:
    """``share(parent, with_owner=child)`` made a loop: a cancel of the child then fenced
    its parent (the parent was "owned" by it). Refused, named, nothing written, at any
    depth."""
    async with ledger.run("job", owner="alice", run_id="loop-p") as parent:
        async with (
            parent.child("sub", run_id="loop-c") as child,
            child.child("deeper", run_id="loop-g") as grandchild,
        ):
            before = await ledger.backend.events(parent.id)
            for owner in (child.id, grandchild.id):
                with pytest.raises(InvalidInput, match=r"with_owner.*owned by run 'loop-p'"):
                    await ledger.share(parent.id, with_owner=owner, by="alice")
            assert await ledger.backend.events(parent.id) == before
        await ledger.cancel(child.id, by="alice")
        assert (await ledger.reads.run(parent.id)).state is RunState.RUNNING
        await ledger.cancel(parent.id, by="alice")


async def test_a_parents_resume_leaves_a_child_another_principal_paused(
    ledger: stopline.Ledger,
) -> None:
    """Bob pauses his child run; Alice pauses the parent (the child, paused already, is
    not hers to stop), then resumes it: the child was resumed with it, which the policy
    refuses Alice directly. A resume moves the runs its pause stopped; the child waits
    for Bob."""
    async with ledger.run("job", owner="alice", run_id="pp") as parent:
        async with ledger.run("sub", owner="bob", run_id="pc", parent_id=parent.id) as child:
            await ledger.pause(child.id, by="bob")
            await ledger.pause(parent.id, by="alice")
            await ledger.resume(parent.id, by="alice")
            assert (await ledger.reads.run(parent.id)).state is RunState.RUNNING
            assert (await ledger.reads.run(child.id)).state is RunState.PAUSED
            with pytest.raises(NotPermitted):
                await ledger.resume(child.id, by="alice")
            await ledger.resume(child.id, by="bob")
            assert (await ledger.reads.run(child.id)).state is RunState.RUNNING
            async with ledger.run("sub2", owner="alice", run_id="pc2", parent_id=parent.id):
                await ledger.pause(parent.id, by="alice")  # hers: paused with the parent
                assert (await ledger.reads.run("pc2")).state is RunState.PAUSED
                await ledger.resume(parent.id, by="alice")
                assert (await ledger.reads.run("pc2")).state is RunState.RUNNING
        await ledger.cancel(parent.id, by="alice")
