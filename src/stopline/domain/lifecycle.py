"""Values of the lifecycle: cancel results, approvals, checkpoints, principals and policy.

Pure: the access policy decides from a principal, an action and a run record.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection
from typing import Any

from stopline.domain.model import RunRecord

__all__ = [
    "DEFAULT_TENANT",
    "SYSTEM",
    "AccessPolicy",
    "Action",
    "ApprovalRecord",
    "ApprovalStatus",
    "CancelResult",
    "Checkpoint",
    "OwnerOrTenantAdmin",
    "Principal",
    "is_system",
    "operator",
    "tenant_of",
]


@dataclasses.dataclass(frozen=True, slots=True)
class CancelResult:
    """What one cancel did, in one transaction."""

    run: RunRecord  # the run asked for, as it is now
    first: bool  # False when it was already cancelled (R7) or had ended
    fenced: tuple[str, ...]  # every run fenced: the run and what it owned exclusively
    released: tuple[str, ...]  # shared children that lost this owner (R6)


class ApprovalStatus(enum.StrEnum):
    PENDING = "pending"
    GRANTED = "granted"
    DENIED = "denied"
    EXPIRED = "expired"
    WITHDRAWN = "withdrawn"  # by a cancel


@dataclasses.dataclass(frozen=True, slots=True)
class ApprovalRecord:
    id: str
    run_id: str
    scope: str  # the operation id it approves
    approver: str
    status: ApprovalStatus
    expires_at: float | None
    requested_by: str
    decided_by: str | None
    created_at: float
    decided_at: float | None

    def valid_at(self, now: float) -> bool:
        return self.status is ApprovalStatus.GRANTED and (
            self.expires_at is None or self.expires_at > now
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Checkpoint:
    """An evidenced checkpoint: every operation before it was resolved when it was taken."""

    run_id: str
    seq: int
    name: str
    at: float
    state: Any  # what the workflow saved to continue from
    operations: tuple[str, ...]  # the operations that preceded it


class Action(enum.StrEnum):
    """What R11 governs."""

    CANCEL = "cancel"
    PAUSE = "pause"
    RESUME = "resume"
    APPROVE = "approve"
    REQUEST_APPROVAL = "request_approval"
    COMPENSATE = "approve_compensation"
    RESOLVE_REVIEW = "resolve_review"
    STOP_COMPENSATION = "stop_compensation"
    SHARE = "share"  # make a run one more owner of another (R6): who cancels it changes


DEFAULT_TENANT = "default"  # a run's tenant when none is given; a bare principal's tenant


def tenant_of(run: RunRecord) -> str:
    """The run's tenant (``DEFAULT_TENANT`` for a run written with none)."""
    return run.tenant or DEFAULT_TENANT


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    """Who acts. A bare string ``"user:42"`` is a principal with no tenant and no roles:
    it sees the runs of the default tenant (runs created without a tenant) only."""

    id: str
    tenant: str | None = None
    roles: frozenset[str] = frozenset()

    @classmethod
    def of(cls, who: str | Principal) -> Principal:
        return who if isinstance(who, Principal) else cls(who)

    def __str__(self) -> str:
        return self.id


# stopline's own background actions. Recognised by identity, never by its id: a caller
# who passes the string "stopline" (or builds an equal Principal) is not stopline, and
# a caller claiming that id is refused (R11).
SYSTEM = Principal("stopline", tenant="*", roles=frozenset({"system"}))


def is_system(principal: Principal) -> bool:
    return principal is SYSTEM


def operator(name: str) -> Principal:
    """An operator of every tenant: how the CLI and the console act (the default policy
    lets operators act on any run; whoever holds the ledger holds its runs anyway)."""
    return Principal(name, tenant="*", roles=frozenset({"operator"}))


class AccessPolicy:
    """Decides who may do what to a run. Subclass and override ``allows``."""

    def allows(self, principal: Principal, action: Action, run: RunRecord) -> bool:
        raise NotImplementedError

    def visible(self, principal: Principal, run: RunRecord) -> bool:
        """A principal of another tenant never sees a run; one without a tenant sees the
        runs without one (the default tenant's)."""
        if principal.id == SYSTEM.id and not is_system(principal):
            return False  # a forged "stopline" sees nothing
        tenant = DEFAULT_TENANT if principal.tenant is None else principal.tenant
        return tenant in (tenant_of(run), "*")


class OwnerOrTenantAdmin(AccessPolicy):
    """The default: the run's owner; an ``admin`` of the run's tenant; an ``operator``
    of any tenant (the CLI and console act as operators: whoever holds the ledger
    file or database already holds every run); and stopline itself."""

    def __init__(
        self,
        *,
        admin_roles: Collection[str] = ("admin",),
        operator_roles: Collection[str] = ("operator",),
    ) -> None:
        self.admin_roles = frozenset(admin_roles)
        self.operator_roles = frozenset(operator_roles)

    def allows(self, principal: Principal, action: Action, run: RunRecord) -> bool:
        if is_system(principal):
            return True
        if principal.id == SYSTEM.id:
            return False  # a forged "stopline": only the runtime itself acts as stopline
        if principal.roles & self.operator_roles and principal.tenant in (None, "*"):
            return True
        if not self.visible(principal, run):
            return False
        if principal.id == run.owner:
            return True
        return principal.tenant == run.tenant and bool(principal.roles & self.admin_roles)
