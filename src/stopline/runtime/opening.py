"""``stopline.open``: a ledger for a URL, to use as ``async with``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from stopline.domain.lifecycle import AccessPolicy
from stopline.ledger.backend import Backend
from stopline.runtime.ledger import Ledger
from stopline.runtime.settle import VerifyBudget
from stopline.runtime.tool import Tool

__all__ = ["open"]


def open(
    url: str | None = None,
    *,
    verify: VerifyBudget | None = None,
    observers: Sequence[Callable[[Backend], Backend]] = (),
    access: AccessPolicy | None = None,
    tools: Sequence[Tool[Any]] = (),
    durable_outcomes: bool = False,
) -> Ledger:
    """A ledger for ``url`` (default ``$STOPLINE_LEDGER`` or ``sqlite:///stopline.db``).

    Use it as ``async with stopline.open(url) as ledger``. ``tools`` are known
    from the start, so operations a crashed worker left in doubt can be verified.
    By default a call returns once its intent is durable and its outcome is queued:
    the outcome commits with the next write, within a few milliseconds (one fsync
    per call on SQLite). ``durable_outcomes=True`` is the strict mode: a call
    returns only once its outcome is durable too (docs/decisions/0022).
    """
    return Ledger(
        url,
        verify=verify,
        observers=observers,
        access=access,
        tools=tools,
        durable_outcomes=durable_outcomes,
    )
