"""What a tool sees of its own call: its idempotency key, and how to report."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stopline.domain.model import Evidence
from stopline.domain.vocab import EvidenceKind, OpEvent
from stopline.ledger.backend import OutcomeUpdate

if TYPE_CHECKING:
    from stopline.runtime.ledger import Ledger
    from stopline.runtime.tool import Tool

__all__ = ["CallContext"]


class CallContext:
    """Handed to an effectful tool as ``ctx``; also to its cancel and verify."""

    __slots__ = (
        "_accepted", "_ledger", "attempt", "lost_recorded", "op_id", "provider_ref", "run_id",
        "tool",
    )  # fmt: skip

    def __init__(
        self, ledger: Ledger, run_id: str, op_id: str, tool: Tool[object], attempt: int = 1
    ) -> None:
        self._ledger = ledger
        self.run_id = run_id
        self.op_id = op_id
        self.tool = tool
        self.attempt = attempt
        self.provider_ref = ""
        self._accepted = False
        # interrupted by a cancel that recorded it already, with the rest of its tree
        self.lost_recorded = False

    @property
    def key(self) -> str:
        """The idempotency key to hand to the provider: the operation's id."""
        return self.op_id

    async def accepted(self, ref: str = "", detail: str = "") -> None:
        """The provider acknowledged the request (recorded before this returns)."""
        if self._accepted:
            return
        self._accepted = True
        if ref:
            self.provider_ref = ref
        evidence = [Evidence(EvidenceKind.PROVIDER_RECEIPT, ref or "accepted", detail)]
        await self._ledger._outbox.record(self.op_id, OutcomeUpdate(OpEvent.ACCEPTED, evidence))

    async def progress(
        self, progress: float, total: float | None = None, message: str = ""
    ) -> None:
        """Progress is advisory: it is recorded and never proves a commit."""
        await self._ledger.backend.note(
            self.op_id, "progress", {"progress": progress, "total": total, "message": message}
        )
