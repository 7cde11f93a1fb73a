"""A receipt's lines carry each operation's evidence as recorded, decoded when shown:
a long run's receipt does not decode thousands of evidence lists to build its lines
(~60% of building a 5,000-line receipt). Counted, not timed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

import stopline
from stopline.domain.model import Evidence
from stopline.testing import FakeProvider


async def test_a_receipt_decodes_evidence_only_when_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    send = FakeProvider("send")
    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}") as ledger:
        async with ledger.run("r", owner="u") as run:
            for i in range(3):
                await run.call(send.tool, i)
        recorded = [tuple(op.evidence) for op in await ledger.reads.operations(run.id)]
        decoded: list[Mapping[str, str]] = []
        original = Evidence.from_json.__func__  # type: ignore[attr-defined]

        def counted(cls: type[Evidence], data: Mapping[str, str]) -> Evidence:
            decoded.append(data)
            return original(cls, data)  # type: ignore[no-any-return]

        monkeypatch.setattr(Evidence, "from_json", classmethod(counted))
        receipt = await ledger.receipt(run.id)
        assert len(receipt.lines) == 3
        assert decoded == []  # built without decoding any
        shown = receipt.to_json()
        assert decoded  # shown: decoded now
    assert [tuple(line.evidence) for line in receipt.lines] == recorded
    assert [len(line["evidence"]) for line in shown["operations"]] == [len(e) for e in recorded]
    assert all(recorded)
