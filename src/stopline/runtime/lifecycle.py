"""Lifecycle: child runs and ownership, pause and resume, approvals, authority.

``LifecycleMixin`` gives ``Ledger`` its methods for trees of runs and for
stopping without cancelling (CONTRACT.md R1, R6, R7, R9, R10, R11). Every
governed action is checked against ``ledger.access`` (an ``AccessPolicy``)
and lands in the audit trail: an allowed one as its own event (which records
who), a denied one as a ``denied`` event, then ``NotPermitted``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from stopline.domain.guidance import what_to_do
from stopline.domain.lifecycle import (
    Action,
    ApprovalRecord,
    ApprovalStatus,
    Checkpoint,
    Principal,
)
from stopline.domain.limits import check_id, sanitise
from stopline.domain.model import RunRecord
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import RunState
from stopline.errors import (
    ApprovalNeeded,
    IllegalTransition,
    NotPermitted,
    RunEnded,
    UnknownRun,
)

if TYPE_CHECKING:
    from stopline.runtime.ledger import Ledger
    from stopline.runtime.tool import Tool

__all__ = ["ApprovalNeeded", "LifecycleMixin", "Resumed", "Retry"]

R = TypeVar("R")


@dataclasses.dataclass(frozen=True, slots=True)
class Retry:
    """Attempts of one operation, each through the gate under the same id.

    A retry that fires after the fence is refused there (R1); an attempt whose
    predecessor's outcome is unknown is read back first, never re-sent blindly (R5).
    """

    attempts: int = 3
    backoff: float = 0.5
    factor: float = 2.0
    max_backoff: float = 30.0

    def delays(self) -> list[float]:
        out, delay = [], self.backoff
        for _ in range(self.attempts - 1):
            out.append(min(delay, self.max_backoff))
            delay *= self.factor
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class Resumed:
    run: RunRecord
    checkpoint: Checkpoint | None  # where the workflow may continue from
    expired_approvals: tuple[str, ...]  # to be asked for again (R10)

    def to_json(self) -> dict[str, Any]:
        checkpoint = self.checkpoint
        return {
            "run_id": self.run.id,
            "run_state": self.run.state.value,
            "checkpoint": None
            if checkpoint is None
            else {
                "seq": checkpoint.seq,
                "name": checkpoint.name,
                "state": checkpoint.state,
                "operations": list(checkpoint.operations),
            },
            "expired_approvals": list(self.expired_approvals),
        }

    def __str__(self) -> str:
        where = "the start" if self.checkpoint is None else f"checkpoint {self.checkpoint.name!r}"
        expired = (
            f"; ask again for {len(self.expired_approvals)} expired approvals"
            if (self.expired_approvals)
            else ""
        )
        return f"Resumed run {self.run.id}: continue from {where}{expired}."


class LifecycleMixin:
    """Methods of ``Ledger`` about the shape and the pauses of runs."""

    @property
    def _host(self) -> Ledger:
        """This object as the ``Ledger`` it is mixed into."""
        return cast("Ledger", self)

    # -- authority (R11) ------------------------------------------------------------
    async def authorize(
        self, who: str | Principal, action: Action, run_id: str
    ) -> tuple[Principal, RunRecord]:
        """Check ``who`` may do ``action`` to the run; a denial is audited, then raised."""
        principal = Principal.of(who)
        check_id("by", principal.id)
        check_id("run_id", run_id)
        local = self._host._local.get(run_id)
        # a run of this process: owner and tenant never change, so no read before the fence
        run = local.record if local is not None else await self._host.backend.get_run(run_id)
        if not self._host.access.visible(principal, run):
            await self._host.backend.audit(
                run_id,
                principal=principal.id,
                action=action.value,
                allowed=False,
                detail="other tenant",
            )
            raise UnknownRun(run_id)  # another tenant never learns the run exists
        if not self._host.access.allows(principal, action, run):
            await self._host.backend.audit(
                run_id,
                principal=principal.id,
                action=action.value,
                allowed=False,
                detail="denied by policy",
            )
            raise NotPermitted(f"{principal.id} may not {action.value} run {run_id!r}")
        return principal, run

    # -- pause and resume (R9, R10) ---------------------------------------------------
    async def pause(self, run_id: str, *, by: str | Principal, reason: str = "") -> Receipt:
        """Stop dispatch at the next boundary; in-flight work finishes and is recorded."""
        principal, _ = await self._host.authorize(by, Action.PAUSE, run_id)
        reason = sanitise(reason)
        for paused in await self._host.backend.pause(run_id, by=principal.id, reason=reason):
            local = self._host._local.get(paused)
            if local is not None:
                local.pause_requested = True
            self._host._changed(paused)
        return await self._host.receipt(run_id)

    async def resume(self, run_id: str, *, by: str | Principal) -> Resumed:
        """Back to running with ``initiate`` re-granted by a principal allowed to resume.

        A cancelled run resumes only when every operation is resolved; approvals that
        expired meanwhile are marked so and must be asked for again (R10).
        """
        principal, current = await self._host.authorize(by, Action.RESUME, run_id)
        try:
            run, expired = await self._host.backend.resume(run_id, by=principal.id)
        except IllegalTransition as exc:
            state = (await self._host.backend.get_run(run_id)).state
            if state is RunState.RUNNING:
                raise
            latest = dataclasses.replace(current, state=state)
            raise RunEnded(run_id, state, what_to_do(latest)) from exc
        local = self._host._local.get(run_id)
        if local is not None:
            local.pause_requested = False
            local.cancel_requested = False
        self._host._changed(run_id)
        return Resumed(run, await self._host.backend.last_checkpoint(run_id), tuple(expired))

    async def _settle_pause(self, run_id: str) -> None:
        await self._host.backend.settle_pause(run_id)
        self._host._changed(run_id)

    # -- ownership (R6) -------------------------------------------------------------
    async def share(self, run_id: str, *, with_owner: str) -> None:
        """Add ``with_owner`` as another owner of a shared run (reference-counted)."""
        await self._host.backend.add_owner(run_id, with_owner, exclusive=False)

    # -- approvals (S5) ---------------------------------------------------------------
    async def request_approval(
        self, run_id: str, key: str, *, approver: str, by: str | Principal
    ) -> ApprovalRecord:
        """Ask ``approver`` to approve the operation ``key`` of the run."""
        scope = f"{run_id}/{key}"
        approval_id = f"approval_{uuid.uuid4().hex[:12]}"
        return await self._host.backend.request_approval(
            approval_id, run_id, scope, approver=approver, requested_by=Principal.of(by).id
        )

    async def approve(
        self, approval_id: str, *, by: str | Principal, ttl: float | None = None
    ) -> ApprovalRecord:
        """Grant an approval, valid for ``ttl`` seconds (forever when None)."""
        return await self._host._decide(approval_id, by, granted=True, ttl=ttl)

    async def deny(self, approval_id: str, *, by: str | Principal) -> ApprovalRecord:
        return await self._host._decide(approval_id, by, granted=False, ttl=None)

    async def _decide(
        self, approval_id: str, who: str | Principal, *, granted: bool, ttl: float | None
    ) -> ApprovalRecord:
        principal = Principal.of(who)
        approval = await self._host.backend.get_approval(approval_id)
        if principal.id != approval.approver:
            await self._host.authorize(principal, Action.APPROVE, approval.run_id)
        expires_at = None if ttl is None else time.time() + ttl
        decided = await self._host.backend.decide_approval(
            approval_id, granted=granted, by=principal.id, expires_at=expires_at
        )
        self._host._changed(approval.run_id)
        return decided

    async def why_not_approved(self, run_id: str, op_id: str) -> str:
        approvals = [a for a in await self._host.backend.approvals(run_id) if a.scope == op_id]
        if not approvals:
            return "no approval was asked for"
        latest = approvals[-1]
        if latest.status is ApprovalStatus.GRANTED:
            return "the approval expired; ask for it again"
        return f"the approval is {latest.status.value}"

    # -- queues and timers (R1, S11, S14) -----------------------------------------------
    async def dispatch(
        self,
        run_id: str,
        tool: Tool[R] | Callable[..., Awaitable[R]],
        *args: Any,
        key: str,
        **kwargs: Any,
    ) -> R:
        """One gated call on an existing run, from outside its workflow.

        For queue consumers and retry timers: a message redelivered after the
        cancel is refused at the gate (``RunFenced``: ack it and drop it), and
        a redelivery of one that already committed returns the recorded result.
        """
        from stopline.runtime.run import Run

        run = Run(self._host, await self._host.backend.get_run(run_id))
        return await run.call(tool, *args, key=key, **kwargs)
