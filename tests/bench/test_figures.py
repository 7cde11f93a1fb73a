"""The bench's table: each figure's unit once, beside its value, and its target as written."""

from __future__ import annotations

from stopline.bench.figures import Figure


def test_a_row_gives_the_unit_beside_the_value_and_the_target_as_written() -> None:
    row = Figure("cancel_inprocess_p99_ms", 2.4, "ms", 0.1, "<= 1.0 ms").row(30)
    assert row.split() == [
        "cancel_inprocess_p99_ms",
        "2.4",
        "ms",
        "0.1",
        "24.00",
        "<=",
        "1.0",
        "ms",
    ]
    bare = Figure("gate_sqlite_wal_pages", 6.4, "pages").row(30)
    assert bare.split() == ["gate_sqlite_wal_pages", "6.4", "pages", "-", "-"]
