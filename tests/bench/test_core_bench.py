"""The core bench's counted figure: WAL pages per transaction, ours beside the bare one."""

from __future__ import annotations

from pathlib import Path

from stopline.bench.core import wal_pages


async def test_wal_pages_counts_a_call_and_a_bare_transaction(tmp_path: Path) -> None:
    ours, bare = await wal_pages(tmp_path)
    # the bare transaction: its table's leaf and its key's index leaf, and the header
    # page now and then as the file grows
    assert 2 <= bare < 2.5
    # a call: the operation and its three indexes, the log and its index (ADR 0035)
    assert 6 <= ours < 8
