"""JSON text as the ledger writes it, by encoders made once.

``json.dumps`` with any option but its defaults builds a new ``JSONEncoder`` on
every call (~0.9 us of a ~1.8 us dump of a small value, measured); a gated call
makes several such dumps (its arguments' and its result's digests, its result,
its outcome's evidence). Each function here is exactly ``json.dumps`` with the
options its name gives, but for one bound: a value nested more than
``MAX_DEPTH`` arrays and objects deep raises ``RecursionError``, wherever it is
written from. An encoder keeps no state between calls, so one is shared by every
thread.

Why the bound (ADR 0095): ``json`` writes and reads a level of nesting with a
level of Python's recursion, so whether a value ~1,000 levels deep can be
written, or read back, depended on how deep the stack already was where it
happened. The runtime digests a result in one place, the ledger writes it in
another (the SQLite writer's thread, PostgreSQL's group commit in the loop) and
any reader reads it at a third: one value was kept on SQLite and dropped on
PostgreSQL with nothing saying so (a replay returned ``None``), or kept and then
unreadable (the read raised ``RecursionError``). At ``MAX_DEPTH`` the answer is
the same everywhere, and what is written reads back with room to spare.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_DEPTH", "canonical", "canonical_or_repr", "compact", "compact_or_str", "depth_over"]

# the deepest nesting of arrays and objects written; serde_json's default bound is 128,
# Python's recursion limit 1,000 (less the frames of whoever reads)
MAX_DEPTH = 256

_COMPACT = (",", ":")

# the text's brackets only, as parentheses: ``[`` and ``{`` open, ``]`` and ``}`` close
_BRACKETS = bytes.maketrans(b"[]{}", b"()()")
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_NOT_STRUCTURE = bytes(range(256)).translate(None, b'"[]{}')


def depth_over(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON text ``text`` (as ``json.dumps`` writes it: ASCII) nests arrays
    and objects more than ``limit`` deep. Each pass takes one level off every innermost
    pair; text of fewer than ``limit`` pairs is never deeper (almost every value: a
    ``len``). The brackets in strings are counted at first (no string is parsed), and
    only a text that seems too deep that way is read again without its strings."""
    if len(text) <= 2 * limit:
        return False
    brackets = text.encode("ascii", "replace").translate(_BRACKETS, _NOT_BRACKETS)
    if len(brackets) <= 2 * limit or _reduced(brackets, limit):
        return False
    if "\\" in text:  # escapes first: what remains of each string is quote to quote
        text = text.replace("\\\\", "").replace('\\"', "")
    structure = text.encode("ascii", "replace").translate(_BRACKETS, _NOT_STRUCTURE)
    return not _reduced(b"".join(structure.split(b'"')[::2]), limit)


def _reduced(brackets: bytes, limit: int) -> bool:
    """Whether ``limit`` passes, each taking off every innermost ``()``, leave nothing."""
    for _ in range(limit):
        brackets = brackets.replace(b"()", b"")
        if not brackets:
            return True
    return False


def _bounded(encode: Callable[[Any], str]) -> Callable[[Any], str]:
    def bounded(value: Any) -> str:
        text = encode(value)
        if len(text) > 2 * MAX_DEPTH and depth_over(text):
            raise RecursionError(f"nested more than {MAX_DEPTH} levels deep")
        return text

    return bounded


# ``json.dumps(value, separators=(",", ":"))``
compact: Callable[[Any], str] = _bounded(json.JSONEncoder(separators=_COMPACT).encode)
# the same, anything JSON cannot write as its ``str``
compact_or_str: Callable[[Any], str] = _bounded(
    json.JSONEncoder(separators=_COMPACT, default=str).encode
)
# keys sorted too: equal values, equal text (what digests are taken of)
canonical: Callable[[Any], str] = _bounded(
    json.JSONEncoder(sort_keys=True, separators=_COMPACT).encode
)
# the same, anything JSON cannot write as its ``repr``
canonical_or_repr: Callable[[Any], str] = _bounded(
    json.JSONEncoder(sort_keys=True, separators=_COMPACT, default=repr).encode
)
