"""Sharing a run with one more owner (R6), governed as every other action (R11).

An owner decides what stops a run: a shared run is fenced only with its last owner
(R6). So adding one is an action on both runs, as ``ledger.share`` does it: the
principal must be allowed ``Action.SHARE`` on the shared run and on the run that
becomes its owner (a denial audited on the run it was denied on, one of another
tenant told it does not exist), and both runs must be of one tenant, as a child run
is of its parent's (ADR 0065). Before, anyone could make any run an owner of any
other: one tenant's run kept another's alive past its owner's cancel, or made its
own cancel fence it. The allowed share is in the audit trail as its link's own event,
``owner_added``, naming who made it (``by``), as a cancel's event names who cancelled:
a separate ``audit`` event after the link was lost with a crash in between.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from stopline.domain.lifecycle import Action, Principal, tenant_of
from stopline.domain.limits import check_id
from stopline.domain.model import RunRecord
from stopline.errors import InvalidInput

if TYPE_CHECKING:
    from stopline.runtime.core import Core

__all__ = ["share"]

# ``Lifecycle.authorize``: the principal and the run, or the denial audited and raised
Authorize = Callable[[str | Principal, Action, str], Awaitable[tuple[Principal, RunRecord]]]


async def share(
    core: Core, authorize: Authorize, run_id: str, *, with_owner: str, by: str | Principal
) -> None:
    """The run ``with_owner`` becomes one more owner of the run ``run_id``, if ``by``
    may share both: the link and its ``owner_added`` event (which owner, who made it)
    are one write. A refusal (policy, tenant, a loop) writes the denial at most."""
    check_id("with_owner", with_owner)  # a run's id: "" or 5 was an unknown run before
    check_id("run_id", run_id)
    principal, shared = await authorize(by, Action.SHARE, run_id)
    _, owner = await authorize(principal, Action.SHARE, with_owner)
    if tenant_of(shared) != tenant_of(owner):
        raise InvalidInput(
            "with_owner", f"run {with_owner!r} is not of run {run_id!r}'s tenant: it cannot own it"
        )
    # the link and who made it, one transaction: as a cancel's event names its ``by``
    await core.backend.add_owner(run_id, with_owner, exclusive=False, by=principal.id)
