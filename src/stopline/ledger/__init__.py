"""Storage: the backend seam and the backends, chosen by URL and imported lazily."""

from __future__ import annotations

import os
from pathlib import Path

from stopline.errors import LedgerUnavailable
from stopline.ledger.backend import Backend

__all__ = ["DEFAULT_URL", "Backend", "open_backend", "resolve_url"]

DEFAULT_URL = "sqlite:///stopline.db"
ENV_VAR = "STOPLINE_LEDGER"


def resolve_url(url: str | None) -> str:
    """The URL given, else ``$STOPLINE_LEDGER``, else ``sqlite:///stopline.db``."""
    return url or os.environ.get(ENV_VAR) or DEFAULT_URL


async def open_backend(url: str | None = None) -> Backend:
    url = resolve_url(url)
    if url.startswith("sqlite:///"):
        from stopline.ledger.sqlite import SQLiteBackend

        return await SQLiteBackend.open(Path(url.removeprefix("sqlite:///")))
    if url.startswith(("postgresql://", "postgres://")):
        raise LedgerUnavailable(url, "the PostgreSQL backend is not part of this release")
    raise LedgerUnavailable(url, "unsupported ledger URL; use sqlite:///PATH")
