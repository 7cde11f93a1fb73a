"""A ledger opened through one backend observer, and that observer (for tests that
count or fault what the runtime asks of its backend)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import stopline
from stopline.ledger.backend import Backend

B = TypeVar("B", bound=Backend)


@contextlib.asynccontextmanager
async def open_observed(
    url: str, wrap: Callable[[Backend], B]
) -> AsyncIterator[tuple[stopline.Ledger, B]]:
    """``stopline.open(url)`` with ``wrap`` around its backend; the ledger and the wrap."""
    observed: list[B] = []

    def observe(backend: Backend) -> Backend:
        observed.append(wrap(backend))
        return observed[-1]

    async with stopline.open(url, observers=[observe]) as ledger:
        yield ledger, observed[0]
