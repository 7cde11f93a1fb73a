"""The fast paths of issue 18 give exactly what the plain forms give: digests, ids, event data.

``args_digest`` skips the canonical rewrite for plain JSON (exact scalar types, str
keys); ``result_digest`` digests and tells JSON-ness in one pass. Neither may change a
digest: an operation's key is checked against its arguments' digest across processes
and releases, so a different digest for the same arguments is an idempotency conflict.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stopline.domain import jsontext
from stopline.domain.limits import MAX_RESULT_CHARS, check_id, sanitise
from stopline.domain.model import Evidence, _canonical, args_digest, digest, result_digest
from stopline.domain.vocab import Cause, EvidenceKind, OpEvent
from stopline.errors import InvalidInput
from stopline.ledger import rows
from stopline.ledger.backend import OutcomeUpdate
from stopline.ledger.engine.record import record_params


def _slow_args_digest(value: Any) -> str:
    """The canonical path alone, as it was before the fast path."""
    text = json.dumps(_canonical(value, "args", set()), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


_scalars = st.none() | st.booleans() | st.integers() | st.text() | st.floats()
_keys = st.text() | st.integers() | st.booleans() | st.floats(allow_nan=False)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(_keys, inner, max_size=4)
        | st.frozensets(st.integers(), max_size=3)
    ),
    max_leaves=12,
)


@given(_values)
def test_args_digest_fast_path_equals_the_canonical_form(value: Any) -> None:
    assert args_digest([[value], {"k": value}]) == _slow_args_digest([[value], {"k": value}])


_SEP = (",", ":")
# each of jsontext's encoders made once, and the ``json.dumps`` call it stands for
_DUMPS: dict[Callable[[Any], str], Callable[[Any], str]] = {
    jsontext.compact: lambda v: json.dumps(v, separators=_SEP),
    jsontext.compact_or_str: lambda v: json.dumps(v, separators=_SEP, default=str),
    jsontext.canonical: lambda v: json.dumps(v, sort_keys=True, separators=_SEP),
    jsontext.canonical_or_repr: lambda v: json.dumps(
        v, sort_keys=True, separators=_SEP, default=repr
    ),
}


class _Opaque:
    """Neither JSON nor anything ``json`` knows: only a ``default`` writes it (``str``
    and ``repr`` apart, so which one is told)."""

    def __str__(self) -> str:
        return "opaque"


def _answers_alike(
    expected: Callable[[Any], object], got: Callable[[Any], object], value: Any
) -> None:
    """``got(value)`` gives what ``expected(value)`` gives, or raises what it raises."""
    try:
        answer = expected(value)
    except (TypeError, ValueError) as exc:  # not writable, not digestible: the same error
        with pytest.raises(type(exc)):
            got(value)
        return
    assert got(value) == answer


@given(_values | st.builds(lambda v: [v, _Opaque()], _values))
def test_json_text_encoders_write_what_json_dumps_writes(value: Any) -> None:
    for encode, dumps in _DUMPS.items():
        _answers_alike(dumps, encode, value)


class Colour(enum.IntEnum):
    RED = 1


def test_values_that_json_writes_otherwise_take_the_canonical_path() -> None:
    # int keys: json sorts them as numbers before writing them as strings, the
    # canonical form sorts the strings ("10" < "9"); an IntEnum is its value
    for value in ({10: "a", 9: "b"}, {True: 1}, [Colour.RED], [math.inf], (1, (2,))):
        assert args_digest(value) == _slow_args_digest(value)


def _replayable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


@given(_values)
def test_result_digest_equals_digest_and_tells_json(value: Any) -> None:
    """As ``digest``, but never raising: an answer proves its call happened whatever it
    holds, so what ``digest`` cannot write out is digested by its type, not kept."""
    try:
        expected = (digest(value), _replayable(value))
    except (TypeError, ValueError):
        response, why = result_digest(value)
        assert response.startswith("sha256:")
        assert why is not None and "cannot be written out" in why
        return
    assert _digest_and_kept(value) == expected


def _digest_and_kept(value: Any) -> tuple[str, bool]:
    response, not_kept = result_digest(value)
    return response, not_kept is None


def test_a_result_with_an_object_is_digested_by_repr_and_not_replayable() -> None:
    class Thing:
        def __repr__(self) -> str:
            return "Thing()"

    assert result_digest({"x": Thing()}) == (
        digest({"x": Thing()}),
        "a dict is not JSON: a replay cannot return it",
    )


def test_a_result_longer_than_the_ledger_keeps_is_digested_and_not_kept() -> None:
    """Its digest is the digest of its JSON; the ledger writes its outcome without it."""
    at_most, longer = "x" * (MAX_RESULT_CHARS - 2), "x" * (MAX_RESULT_CHARS - 1)  # with quotes
    assert result_digest(at_most) == (digest(at_most), None)
    response, why = result_digest(longer)
    assert response == digest(longer)
    assert why is not None and f"{MAX_RESULT_CHARS:,}" in why
    assert rows.dump_result(at_most, True) == (f'"{at_most}"', True)
    assert rows.dump_result(longer, True) == (None, False)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("a\x00b", "NUL"),
        ("a\ud800b", "lone surrogate"),
        ("a\x1fb", "control character"),
        ("a\x7fb", "control character"),
        ("a\nb", "control character"),
    ],
)
def test_check_id_names_what_is_wrong(value: str, why: str) -> None:
    with pytest.raises(InvalidInput, match=why):
        check_id("key", value)


@given(st.text(min_size=1, max_size=50))
def test_check_id_accepts_exactly_what_it_accepted(value: str) -> None:
    bad = any(ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF for c in value)
    if bad:
        with pytest.raises(InvalidInput):
            check_id("key", value)
    else:
        assert check_id("key", value) == value


@given(
    st.lists(
        st.builds(Evidence, st.sampled_from(list(EvidenceKind)), st.text(), st.text()),
        max_size=3,
    ),
    st.none() | st.sampled_from(list(Cause)),
    st.none() | st.text(),
    st.booleans(),
)
def test_an_outcome_event_data_is_the_json_of_its_fields(
    evidence: list[Evidence], cause: Cause | None, error: str | None, late: bool
) -> None:
    """``record_params`` writes the event's data from the evidence items it dumped
    already; the text is exactly what dumping the whole dict gives."""
    update = OutcomeUpdate(OpEvent.COMMITTED, evidence, cause=cause, error=error, late=late)
    data: dict[str, Any] = {"evidence": [e.to_json() for e in evidence]}
    if cause is not None:
        data["cause"] = cause.value
    if error is not None:
        data["error"] = sanitise(error)  # as every backend can store it
    if late:
        data["late"] = True
    assert record_params("r/1", update, 1.0)["data"] == rows.dump_data(data)
