"""Break stopline on purpose, for a test, to prove the explorer notices.

Each switch is a context manager that patches one module attribute for its
duration and restores it after; nothing in stopline imports this module, so
production use cannot reach it.

- ``gate_ignores_fence()``: the dispatch gate forgets to check the fence, as
  a retry path that skipped it would: an operation passes the gate after the
  run was cancelled. The explorer must report R1.
- ``receipt_overclaims()``: every receipt says "Canceled before external
  action.", whatever the evidence. The explorer must report R8.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from stopline.domain import receipt as _receipt
from stopline.domain.model import OperationRecord, RunRecord
from stopline.domain.vocab import Headline
from stopline.ledger.engine import gate as _gate

__all__ = ["gate_ignores_fence", "receipt_overclaims"]


@contextlib.contextmanager
def _patched(module: object, name: str, value: object) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def gate_ignores_fence() -> contextlib.AbstractContextManager[None]:
    """The gate records intents without checking the run's state and ``initiate``."""
    intent_sql = _gate.intent_sql

    def leaky(dialect: Any, compensation: bool, approved: bool) -> tuple[str, str]:
        _where, values = intent_sql(dialect, compensation, approved)
        return "runs.id = :run", values

    return _patched(_gate, "intent_sql", leaky)


def receipt_overclaims() -> contextlib.AbstractContextManager[None]:
    """Receipts headline "Canceled before external action." whatever happened."""

    def overclaiming(run: RunRecord, ops: Sequence[OperationRecord]) -> Headline:
        return Headline.CANCELED_BEFORE_EXTERNAL_ACTION

    return _patched(_receipt, "headline_for", overclaiming)
