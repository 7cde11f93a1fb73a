"""Re-entering a child run that has ended, from its parent's re-entry (ADR 0053).

A resumed parent runs its workflow again from the start; a child it had opened
and that completed is reached again by its id (``Run.child`` numbers a parent's
children by name). Such a block only replays: a call the child made and that
happened returns its recorded result, as any replay does (R10); a call it did
not make, or that did not happen, is refused with ``RunEnded``, and so is a new
child of it: an ended run sends nothing. Nothing is written: the gate is not
asked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stopline.domain.guidance import OnResume, on_resume
from stopline.domain.limits import MAX_ID_CHARS, fitted
from stopline.domain.model import OperationSpec, RunRecord
from stopline.domain.vocab import RunState
from stopline.errors import IdempotencyConflict, RunEnded, UnknownOperation
from stopline.ledger.backend import GateResult, GateVerdict, RunSpec

if TYPE_CHECKING:
    from stopline.ledger.backend import Backend
    from stopline.runtime.run import Run

__all__ = ["replay_gate", "replays"]

# a completed child replays; a failed one raises ``RunEnded`` as before (what a call
# that failed there would do now is not on record)
_REPLAYS = frozenset({RunState.COMPLETED})


# a derived child id leaves this much of the ledger's id length for an operation's key
_KEY_ROOM = 256


def child_id(parent_id: str, name: str, opened: dict[str, int]) -> str:
    """The id of the next child named ``name`` of a parent's block, counted in
    ``opened``: ``PARENT:NAME``, then ``PARENT:NAME.2`` ... The name's ``%``, ``:`` and
    ``.`` are written ``%25``, ``%3A``, ``%2E``, so no name reads as another child's
    number or as a grandchild (``a.2``, ``a:b``). Too long (room is kept for its
    operations' keys), or unusable: its printable start and a digest (``fitted``). The
    same workflow opening its children in the same order reaches the same runs."""
    n = opened[name] = opened.get(name, 0) + 1
    plain = name.replace("%", "%25").replace(":", "%3A").replace(".", "%2E")
    derived = f"{parent_id}:{plain}" + ("" if n == 1 else f".{n}")
    return fitted(derived, MAX_ID_CHARS - _KEY_ROOM)


def replays(spec: RunSpec, record: RunRecord) -> bool:
    """Whether entering ``spec`` finds a child of the same parent that completed."""
    return (
        spec.parent_id is not None
        and record.parent_id == spec.parent_id
        and record.state in _REPLAYS
    )


async def replay_gate(backend: Backend, run: Run, spec: OperationSpec) -> GateResult:
    """The gate's answer for a call of a replaying block, read and never written: the
    operation as recorded when it happened, else ``RunEnded``."""
    try:
        op = await backend.get_operation(spec.id)
    except UnknownOperation:
        op = None
    if op is not None and op.args_digest != spec.args_digest:
        raise IdempotencyConflict(spec.id)
    if op is None or on_resume(op.status) is not OnResume.REPLAYED:
        did = "never made" if op is None else f"{op.status.value}, never done"
        raise RunEnded(
            run.id,
            run.record.state,
            f"a call of it that was {did} ({spec.id!r}) is not made now; new work "
            "goes in a child of another name",
        )
    return GateResult(GateVerdict.EXISTING, op, run.record.fence)
