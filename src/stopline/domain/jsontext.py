"""JSON text as the ledger writes it, by encoders made once.

``json.dumps`` with any option but its defaults builds a new ``JSONEncoder`` on
every call (~0.9 us of a ~1.8 us dump of a small value, measured); a gated call
makes several such dumps (its arguments' and its result's digests, its result,
its outcome's evidence). Each function here is exactly ``json.dumps`` with the
options its name gives. An encoder keeps no state between calls, so one is
shared by every thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["canonical", "canonical_or_repr", "compact", "compact_or_str"]

_COMPACT = (",", ":")

# ``json.dumps(value, separators=(",", ":"))``
compact: Callable[[Any], str] = json.JSONEncoder(separators=_COMPACT).encode
# the same, anything JSON cannot write as its ``str``
compact_or_str: Callable[[Any], str] = json.JSONEncoder(separators=_COMPACT, default=str).encode
# keys sorted too: equal values, equal text (what digests are taken of)
canonical: Callable[[Any], str] = json.JSONEncoder(sort_keys=True, separators=_COMPACT).encode
# the same, anything JSON cannot write as its ``repr``
canonical_or_repr: Callable[[Any], str] = json.JSONEncoder(
    sort_keys=True, separators=_COMPACT, default=repr
).encode
