"""What a replayed call hands the model when the ledger holds no result of it.

A call is ``committed`` by its answer (the ledger keeps it, or says why not:
``result_not_kept``), or by a read-back or a reviewer's decision, which prove the
effect and return no answer of the tool (``has_result`` false, unless the
verifier gave one as ``ReadBack(result=...)``). The runtime replays such a call
as ``None`` (ADR 0049); a model handed ``None`` reads "the tool returned
nothing", which the evidence does not say. Every adapter's replay (a history's
repaired return, the Agents SDK's resume note, a call that meets its record at
the gate) tells the model with ``unkept_note`` instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

from stopline.domain.guidance import OnResume, on_resume
from stopline.domain.model import OperationRecord
from stopline.domain.receipt import OperationLine
from stopline.domain.vocab import EvidenceKind
from stopline.integrations._call_ids import unkept_note

if TYPE_CHECKING:
    from stopline.integrations._frameworks import Bound

__all__ = ["for_model", "not_kept", "said_of", "told"]


def not_kept(op: OperationRecord) -> str | None:
    """Why the ledger holds no result of this committed call to return, else ``None``."""
    if op.result_not_kept is not None or op.has_result:
        return op.result_not_kept
    kinds = {e.kind for e in op.evidence}
    if EvidenceKind.READ_BACK in kinds:
        return "a read-back proved it happened; a read-back does not return the tool's answer"
    if EvidenceKind.REVIEW in kinds:
        return "a reviewer decided it happened; the tool's answer was never recorded"
    return "the tool's answer was never recorded"


def for_model(op: OperationRecord) -> Any:
    """A replayed call's answer for the model: its recorded result, or a note."""
    why = not_kept(op)
    return op.result if why is None else unkept_note(op.tool, why)


async def told(bound: Bound, key: str | None, answer: Awaitable[Any]) -> Any:
    """``answer`` (a gated call under ``key``), or, when it is ``None`` because the call
    was replayed from a record that holds no result, ``unkept_note``."""
    result = await answer
    if result is not None or key is None:
        return result
    op = await bound.ledger.backend.get_operation(f"{bound.run.id}/{key}")
    return for_model(op) if on_resume(op.status) is OnResume.REPLAYED else result


def said_of(lines: Sequence[OperationLine], op_id: str) -> str:
    """What the ledger records of ``op_id`` in its receipt's words (``lines``; the one
    wording of what each status proves): its status and its words, its latest
    correction's, and what follows; ``""`` when ``lines`` do not hold it."""
    line = next((line for line in lines if line.op_id == op_id), None)
    if line is None:
        return ""
    said = [f"{line.status.value}: {line.status_words}"]
    said += [
        f"its correction {c.op_id}: {c.status_words}"
        for c in [c for c in lines if c.op_id.startswith(f"{op_id}~compensate")][-1:]
    ]
    said += [f"next: {line.recovery}"] if line.recovery else []
    return "; ".join(said)
