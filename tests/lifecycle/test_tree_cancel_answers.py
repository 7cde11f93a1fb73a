"""Cancelling a tree: the answers known without asking a provider (R12, R14) are written
for the whole tree by one backend call (one transaction), not one call per operation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import stopline
from stopline import CancelState, RunState
from stopline.domain.model import OperationRecord
from stopline.errors import UnknownOperation
from stopline.ledger.backend import Backend, Note
from stopline.ledger.forwarding import ForwardingBackend
from tests.lifecycle.test_tree_cancel import CHILDREN, cancel_a_tree, holding_tool


class CountingNotes(ForwardingBackend):
    """Counts the notes written by each backend call."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.per_call: list[int] = []

    async def note(
        self, op_id: str, kind: str, data: dict[str, Any], cancel_state: str | None = None
    ) -> OperationRecord:
        self.per_call.append(1)
        return await self.inner.note(op_id, kind, data, cancel_state)

    async def note_many(self, notes: Sequence[Note]) -> list[OperationRecord | UnknownOperation]:
        self.per_call.append(len(notes))
        return await self.inner.note_many(notes)


async def test_a_tree_cancel_notes_its_calls_not_asked_in_one_transaction(
    tmp_path: Path,
) -> None:
    hold, all_in = holding_tool()  # its provider cannot be asked to cancel

    counting: list[CountingNotes] = []

    def observe(backend: Backend) -> Backend:
        counting.append(CountingNotes(backend))
        return counting[-1]

    url = f"sqlite:///{tmp_path / 'l.db'}"
    async with stopline.open(url, tools=[hold], observers=[observe]) as ledger:
        root_id = await cancel_a_tree(ledger, hold, all_in)
        receipt = await ledger.wait_settled(root_id, timeout=30)
        ops = await ledger.backend.operations(root_id, descendants=True)
    assert [c.per_call for c in counting] == [[CHILDREN]]  # the whole tree, one call
    assert receipt.run_state is RunState.CANCELLED
    assert {op.cancel_state for op in ops} == {CancelState.NOT_ASKED}
