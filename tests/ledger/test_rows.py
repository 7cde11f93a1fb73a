"""Stored values become members by a dict lookup (``vocab.by_value``, and
``CancelState.parse``, ``Evidence.from_json``), with the same answers as the enum
itself: each member, the old ``none`` read as ``not_asked``, and an error for a value
no member has."""

from __future__ import annotations

from typing import Any

import pytest

from stopline.domain.model import CancelState, Evidence, LazyEvidence
from stopline.domain.vocab import Cancellable, EvidenceKind, OpStatus
from stopline.ledger import rows


def test_each_stored_value_reads_as_the_enum_reads_it() -> None:
    assert all(rows._op_status(s.value) is s for s in OpStatus)
    assert all(rows._cancellable(c.value) is c for c in Cancellable)
    assert all(rows._cancel_state(c.value) is CancelState.parse(c.value) for c in CancelState)
    assert rows._cancel_state("none") is CancelState.NOT_ASKED
    assert CancelState.parse(CancelState.NONE) is CancelState.NOT_ASKED  # a member, as str
    for kind in EvidenceKind:
        assert Evidence.from_json({"kind": kind.value, "ref": "r"}).kind is kind


def test_a_value_no_member_has_is_refused() -> None:
    with pytest.raises(ValueError, match="not_a_status"):
        rows._op_status("not_a_status")
    with pytest.raises(ValueError, match="sometimes"):
        rows._cancellable("sometimes")
    with pytest.raises(ValueError, match="maybe"):
        CancelState.parse("maybe")
    with pytest.raises(ValueError, match="hearsay"):
        Evidence.from_json({"kind": "hearsay", "ref": "r"})


def test_lazy_evidence_is_copied_by_the_tuples_own_iterator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receipt copies each operation's evidence into its line: through the decoded
    tuple's iterator, not ``Sequence``'s index-by-index one (an item, then an
    ``IndexError``). Counted, not timed."""
    raw = '[{"kind":"local","ref":"gate"},{"kind":"response_digest","ref":"sha256:ab"}]'
    evidence = LazyEvidence(raw)
    indexed: list[object] = []
    by_index = LazyEvidence.__getitem__

    def counted(self: LazyEvidence, index: Any) -> Any:
        indexed.append(index)
        return by_index(self, index)

    monkeypatch.setattr(LazyEvidence, "__getitem__", counted)
    copied = tuple(evidence)
    backwards = list(reversed(evidence))
    assert indexed == []
    assert [e.ref for e in copied] == ["gate", "sha256:ab"]
    assert backwards == list(copied)[::-1]
