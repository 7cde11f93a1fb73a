"""R11 probe: asking for an approval is governed, and the approver it names acts only
in the run's tenant.

Before: ``ledger.request_approval`` checked nobody. A principal of another tenant asked
for an approval on a run it could not see, named itself the approver, granted it (the
named approver was never checked), and the run's approval-gated call went out on that
grant; the ask also told it the run existed ("run ... is completed").
"""

from __future__ import annotations

import pytest

import stopline
from stopline import ApprovalStatus, Principal
from stopline.errors import ApprovalNeeded, NotPermitted, UnknownRun
from stopline.testing import FakeProvider

MALLORY = Principal("mallory", tenant="evil")


async def _kinds(ledger: stopline.Ledger, run_id: str) -> list[tuple[str, str]]:
    return [(e.kind, str(e.data.get("action", ""))) for e in await ledger.backend.events(run_id)]


async def test_another_tenants_principal_cannot_ask_for_an_approval(
    ledger: stopline.Ledger,
) -> None:
    pay = FakeProvider("pay")
    async with ledger.run("job", owner="alice", tenant="acme", run_id="acme-run") as run:
        before = await _kinds(ledger, run.id)
        with pytest.raises(UnknownRun):  # it is not told the run exists
            await ledger.request_approval(run.id, "pay", approver="mallory", by=MALLORY)
        with pytest.raises(NotPermitted):  # of the tenant, but neither owner nor admin
            await ledger.request_approval(
                run.id, "pay", approver="bob", by=Principal("bob", tenant="acme")
            )
        with pytest.raises(ApprovalNeeded):  # no grant of theirs lets the call out
            await run.call(pay.tool, 900, key="pay", needs_approval=True)
        after = await _kinds(ledger, run.id)
        assert await ledger.backend.approvals(run.id) == []
        # the owner's own ask, through its run, still works in its tenant
        asked = await run.request_approval("pay", approver="manager:3")
        assert asked.requested_by == "alice"
    assert pay.requests == []
    # only the refusals were written, each to the audit trail
    assert after[len(before) :] == [("denied", "request_approval")] * 2


async def test_the_named_approver_of_another_tenant_cannot_grant(ledger: stopline.Ledger) -> None:
    pay = FakeProvider("pay")
    async with ledger.run("job", owner="alice", tenant="acme", run_id="acme-pay") as run:
        asked = await run.request_approval("pay", approver="manager:3")
        with pytest.raises(UnknownRun):  # the same id in another tenant is someone else
            await ledger.approve(asked.id, by=Principal("manager:3", tenant="evil"), ttl=60)
        (still,) = await ledger.backend.approvals(run.id)
        assert still.status is ApprovalStatus.PENDING
        # the approver of the run's tenant needs no role: the ask named it
        granted = await ledger.approve(asked.id, by=Principal("manager:3", tenant="acme"), ttl=60)
        assert granted.status is ApprovalStatus.GRANTED
        await run.call(pay.tool, 900, key="pay", needs_approval=True)
    assert pay.requests == ["acme-pay/pay"]
    denied = [k for k in await _kinds(ledger, "acme-pay") if k[0] == "denied"]
    assert denied == [("denied", "approve")]
