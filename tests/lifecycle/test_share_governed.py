"""R6/R11: making a run one more owner of another is governed, within one tenant.

Before: ``ledger.share(run_id, with_owner=...)`` took no principal and checked nothing.
Anyone could make any run an owner of any other, across tenants: Mallory's run became
an owner of Acme's run, and Acme's cancel of its own run no longer stopped it (a shared
run is fenced only with its last owner), while Mallory's cancel now did. Now a share
names who makes it (``by=``, as every governed call), which must be allowed
``Action.SHARE`` on both runs; both runs are of one tenant; the allowed share's link
names who made it; a refused one writes its denial at most.
"""

from __future__ import annotations

import pytest

import stopline
from stopline import Principal, RunState, operator
from stopline.domain.vocab import LogKind
from stopline.errors import InvalidInput, NotPermitted, UnknownRun

ALICE = Principal("alice", tenant="acme")
MALLORY = Principal("mallory", tenant="evil")


async def _kinds(ledger: stopline.Ledger, run_id: str) -> list[tuple[str, str]]:
    return [(e.kind, str(e.data.get("action", ""))) for e in await ledger.backend.events(run_id)]


async def _owners_added(ledger: stopline.Ledger, run_id: str) -> list[str]:
    return [
        str(e.data["owner"]) for e in await ledger.backend.events(run_id) if e.kind == "owner_added"
    ]


async def test_a_share_names_who_makes_it(ledger: stopline.Ledger) -> None:
    """``by`` is required, as for a cancel: a share without it is a ``TypeError`` at
    the call, never a link nobody answers for."""
    async with ledger.run("a", owner="alice") as a, ledger.run("b", owner="alice") as b:
        with pytest.raises(TypeError, match="by"):
            await ledger.share(a.id, with_owner=b.id)  # type: ignore[call-arg]
        assert await _owners_added(ledger, a.id) == []
        await ledger.cancel(a.id, by="alice")
        await ledger.cancel(b.id, by="alice")


async def test_another_tenants_principal_cannot_share_a_run(ledger: stopline.Ledger) -> None:
    """Mallory's run cannot be made an owner of Acme's shared child (it would keep it
    going past Acme's cancel of its parent), nor Acme's run one of hers: she is told
    Acme's runs do not exist, each attempt is audited on the run refused, and nothing
    is linked."""
    async with (
        ledger.run("job", owner="alice", tenant="acme", run_id="acme-job") as job,
        ledger.run("s", owner="alice", tenant="acme", parent_id=job.id, shared=True) as acme,
        ledger.run("own", owner="mallory", tenant="evil", run_id="evil-run") as evil,
    ):
        with pytest.raises(UnknownRun):
            await ledger.share(acme.id, with_owner=evil.id, by=MALLORY)
        with pytest.raises(UnknownRun):
            await ledger.share(evil.id, with_owner=job.id, by=MALLORY)
        assert await _owners_added(ledger, acme.id) == []
        assert await _owners_added(ledger, evil.id) == []
        assert [k for k in await _kinds(ledger, acme.id) if k[0] == "denied"] == [
            ("denied", "share")
        ]
        assert [k for k in await _kinds(ledger, job.id) if k[0] == "denied"] == [
            ("denied", "share")
        ]
        await ledger.cancel(job.id, by=ALICE)  # Acme's cancel stops its shared child: no
        assert (await ledger.reads.run(acme.id)).state is not RunState.RUNNING  # owner left
        await ledger.cancel(evil.id, by=MALLORY)


async def test_a_share_needs_leave_on_both_runs(ledger: stopline.Ledger) -> None:
    """Bob, of Acme but neither owner nor admin, may not share Alice's run, nor make
    Alice's run an owner of his: each refusal is ``NotPermitted``, audited on the run
    refused."""
    bob = Principal("bob", tenant="acme")
    async with (
        ledger.run("job", owner="alice", tenant="acme", run_id="alices") as alices,
        ledger.run("job", owner="bob", tenant="acme", run_id="bobs") as bobs,
    ):
        with pytest.raises(NotPermitted, match="bob may not share run 'alices'"):
            await ledger.share(alices.id, with_owner=bobs.id, by=bob)
        with pytest.raises(NotPermitted, match="bob may not share run 'alices'"):
            await ledger.share(bobs.id, with_owner=alices.id, by=bob)
        assert await _owners_added(ledger, alices.id) == []
        assert await _owners_added(ledger, bobs.id) == []
        assert [k for k in await _kinds(ledger, alices.id) if k[0] == "denied"] == [
            ("denied", "share")
        ] * 2
        # an admin of Acme may: both runs are of its tenant
        await ledger.share(
            bobs.id, with_owner=alices.id, by=Principal("root", "acme", frozenset({"admin"}))
        )
        assert await _owners_added(ledger, bobs.id) == [alices.id]
        await ledger.cancel(alices.id, by=ALICE)
        await ledger.cancel(bobs.id, by=bob)


async def test_an_owner_run_is_of_the_shared_runs_tenant(ledger: stopline.Ledger) -> None:
    """An operator sees every tenant, so the policy lets it act on both runs: the
    tenants differ all the same, and that is ``InvalidInput``, nothing written (as a
    child run of another tenant than its parent is)."""
    ops = operator("ops")
    async with (
        ledger.run("job", owner="alice", tenant="acme", run_id="acme-job") as acme,
        ledger.run("job", owner="mallory", tenant="evil", run_id="evil-job") as evil,
        ledger.run("bare", owner="alice", run_id="default-job") as bare,
    ):
        before = {r: await _kinds(ledger, r) for r in (acme.id, evil.id, bare.id)}
        for shared, owner in ((acme.id, evil.id), (evil.id, acme.id), (acme.id, bare.id)):
            with pytest.raises(InvalidInput, match=r"with_owner.*tenant") as refused:
                await ledger.share(shared, with_owner=owner, by=ops)
            assert refused.value.what == "with_owner"
        assert {r: await _kinds(ledger, r) for r in before} == before
        for run in (acme, evil, bare):
            await ledger.cancel(run.id, by=ops)


async def test_an_allowed_share_is_audited_and_goes_on_past_the_first_owner(
    ledger: stopline.Ledger,
) -> None:
    """The owner's share lands, and its link's own event says who made it with which
    owner (no second event: ADR 0065, 5); the first owner's cancel then lets the run go
    on, the second's fences it (R6)."""
    async with (
        ledger.run("a", owner="alice", tenant="acme", run_id="owner-a") as a,
        ledger.run("b", owner="alice", tenant="acme", run_id="owner-b") as b,
        ledger.run("s", owner="alice", tenant="acme", run_id="s", parent_id=a.id, shared=True),
    ):
        await ledger.share("s", with_owner=b.id, by=ALICE)
        added = (await ledger.backend.events("s"))[-1]
        assert added.kind == LogKind.OWNER_ADDED
        assert {k: added.data[k] for k in ("owner", "exclusive", "by")} == {
            "owner": b.id,
            "exclusive": False,
            "by": "alice",
        }
        await ledger.cancel(a.id, by=ALICE)
        assert (await ledger.reads.run("s")).state is RunState.RUNNING
        await ledger.cancel(b.id, by=ALICE)
        assert (await ledger.reads.run("s")).state is not RunState.RUNNING
