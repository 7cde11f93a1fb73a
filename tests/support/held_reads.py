"""A ledger's reads held at a barrier once they have read: how "two entries read at
the same moment" is made certain, with the real backend's answers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import stopline


def held_reads(
    monkeypatch: pytest.MonkeyPatch,
    ledger: stopline.Ledger,
    after: Callable[[], Awaitable[None]],
    read: str = "get_runs",
) -> None:
    """``ledger``'s reads through its backend's ``read`` (``get_runs``: a thread's runs;
    ``get_run``: one run, which raises ``UnknownRun`` for none) each wait for ``after()``
    once they have read, whatever they answered."""
    reading = getattr(ledger.backend, read)

    async def held(*args: Any) -> Any:
        try:
            return await reading(*args)
        finally:
            await after()

    monkeypatch.setattr(ledger.backend, read, held)
