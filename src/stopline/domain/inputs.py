"""Inputs stopline stores: checked at the API, before anything is written.

Ids (runs, operation keys, principals) must be storable as given in every
backend: a non-empty string of at most ``MAX_ID`` characters, valid UTF-8 (no
lone surrogate), no NUL, no other control character. A bad one raises
``InvalidInput`` naming the field; nothing is written. A cancel's reason is
never a reason to refuse a cancel: it is sanitised instead, so the fence
always commits (surrogates and control characters replaced, length capped).
"""

from __future__ import annotations

from stopline.errors import InvalidInput

__all__ = ["MAX_ID", "MAX_REASON", "check_id", "sanitise"]

MAX_ID = 512
MAX_REASON = 4096


def _problem(value: str) -> str | None:
    if not value:
        return "it is empty"
    if len(value) > MAX_ID:
        return f"it is {len(value)} characters long (at most {MAX_ID})"
    if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        return "it holds a lone surrogate (not valid UTF-8)"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return "it holds a NUL or another control character"
    return None


def check_id(field: str, value: object) -> str:
    """``value`` as a storable id, or ``InvalidInput(field, ...)``."""
    if not isinstance(value, str):
        raise InvalidInput(field, f"expected a string, got {type(value).__name__}")
    problem = _problem(value)
    if problem is not None:
        raise InvalidInput(field, f"{value[:40]!r}: {problem}")
    return value


def sanitise(text: str) -> str:
    """A reason as it can be stored: lone surrogates and control characters (but
    newlines and tabs) replaced by U+FFFD, at most ``MAX_REASON`` characters."""
    out = "".join(
        "\ufffd"
        if 0xD800 <= ord(c) <= 0xDFFF or ((ord(c) < 0x20 and c not in "\n\t") or ord(c) == 0x7F)
        else c
        for c in str(text)[:MAX_REASON]
    )
    return out
