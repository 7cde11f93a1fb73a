"""What an id may be, checked before anything is written or sent.

Ids (runs, operation keys, owners, tenants, principals) are stored as text
by every backend and travel to PostgreSQL over the network: a 1 MB id, an
empty one or one with a NUL byte (which PostgreSQL's text cannot hold) is
refused here, at once, with ``InvalidInput`` naming it, never after retries
as a storage error.
"""

from __future__ import annotations

from stopline.errors import InvalidInput

__all__ = ["MAX_ID_CHARS", "check_id"]

MAX_ID_CHARS = 1024


def check_id(what: str, value: object) -> str:
    """``value`` if it is a usable id, else ``InvalidInput`` naming ``what``."""
    if not isinstance(value, str):
        raise InvalidInput(what, f"must be a string, not {type(value).__name__}")
    if not value:
        raise InvalidInput(what, "must not be empty")
    if len(value) > MAX_ID_CHARS:
        raise InvalidInput(what, f"{len(value)} characters; at most {MAX_ID_CHARS}")
    if "\x00" in value:
        raise InvalidInput(what, "contains a NUL character")
    return value
