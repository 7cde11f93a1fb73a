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
from stopline import Principal
from stopline.errors import InvalidInput, UnknownRun


async def test_a_run_cannot_own_itself(ledger: stopline.Ledger) -> None:
    async with ledger.run("refresh", owner="alice", run_id="self-owned") as run:
        before = await ledger.backend.events(run.id)
        with pytest.raises(InvalidInput, match=r"with_owner.*cannot own itself"):
            await ledger.share(run.id, with_owner=run.id)
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
