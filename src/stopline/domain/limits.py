"""What an id, a listing's limit or a wait may be, checked before anything is written
or sent.

Ids (runs, operation keys, owners, tenants, principals) are stored as text
by every backend and travel to PostgreSQL over the network: a 1 MB id, an
empty one or one with a NUL byte (which PostgreSQL's text cannot hold) is
refused here, at once, with ``InvalidInput`` naming it, never after retries
as a storage error.
"""

from __future__ import annotations

import hashlib
import re

from stopline.errors import InvalidInput

__all__ = [
    "BIDI_CONTROLS",
    "MAX_ID_CHARS",
    "MAX_REASON_CHARS",
    "MAX_RESULT_CHARS",
    "MAX_ROWS",
    "bidi_name",
    "check_backoff",
    "check_id",
    "check_limit",
    "check_new_id",
    "check_seconds",
    "check_wait",
    "fitted",
    "replace_unusable",
    "sanitise",
    "shown_whole",
    "storable",
    "with_bidi_shown",
]

MAX_ID_CHARS = 1024
MAX_REASON_CHARS = 4096
# the longest result (JSON text) the ledger keeps; a longer one is digested, not kept
# (a replay cannot return it): SQLite refuses a string past 1e9 bytes and PostgreSQL a
# text past 1 GB, so the outcome of a call that answered could never be written, and a
# write that size holds every other run's records behind it (ADR 0049)
MAX_RESULT_CHARS = 16 * 2**20


def check_id(what: str, value: object) -> str:
    """``value`` if it is a usable id, else ``InvalidInput`` naming ``what``."""
    if not isinstance(value, str):
        raise InvalidInput(what, f"must be a string, not {type(value).__name__}")
    if not value:
        raise InvalidInput(what, "must not be empty")
    if len(value) > MAX_ID_CHARS:
        raise InvalidInput(what, f"{len(value)} characters; at most {MAX_ID_CHARS}")
    if _UNUSABLE.search(value) is None:  # one scan in C: the common case
        return value
    if "\x00" in value:
        raise InvalidInput(what, "contains a NUL character")
    if _SURROGATE.search(value) is not None:
        raise InvalidInput(what, "contains a lone surrogate (not valid UTF-8)")
    raise InvalidInput(what, "contains a control character")


def check_new_id(what: str, value: object) -> str:
    """``check_id``, and for an id being made (a run's id, owner and tenant when it is
    created, an operation's key, a tool's name): no C1 control and no
    bidirectional control either (``BIDI_CONTROLS``), else ``InvalidInput`` naming
    ``what`` and the character. U+202E in a key made "refund-0001" read as another id
    wherever text is not shown as ``with_bidi_shown`` shows it (a log, another tool's
    screen); U+009B is a CSI to some terminals. An id the ledger holds already is
    looked up as it is (``check_id``): one stored before this rule is still reached,
    and cancelled, by its id (ADR 0078)."""
    check_id(what, value)
    assert isinstance(value, str)  # checked above
    found = _NOT_NEW.search(value)
    if found is None:
        return value
    kind = "a C1 control character" if found[0] <= "\x9f" else "a bidirectional control"
    raise InvalidInput(what, f"contains {kind} ({bidi_name(found[0])})")


MAX_ROWS = 2**63 - 1  # the largest LIMIT both engines bind (a 64-bit integer)


def check_limit(what: str, value: object) -> int:
    """``value`` if it is a usable number of rows to read (an integer, 0 or more), else
    ``InvalidInput`` naming ``what``: SQLite reads a negative ``LIMIT`` as none at all
    (a whole ledger for a page), a string reached the storage as its own error, and
    one past 64 bits as ``OverflowError`` (SQLite) or "bigint out of range"."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(what, f"must be an integer, not {type(value).__name__}")
    if not 0 <= value <= MAX_ROWS:
        raise InvalidInput(what, f"{value}: must be 0 to {MAX_ROWS}")
    return value


def check_seconds(what: str, value: object) -> float | None:
    """``value`` if it is a usable wait (``None``: none; else a real number of seconds,
    0 or more, infinity meaning none), else ``InvalidInput`` naming ``what``. Checked
    before a call passes the gate: a NaN or a string reached the deadline after the
    intent was durable, and left a call that never left recorded ``unknown``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(what, f"must be a number of seconds, not {type(value).__name__}")
    if not value >= 0:  # NaN too
        raise InvalidInput(what, f"{value}: must be 0 or more seconds")
    return float(value)


def check_wait(what: str, value: object) -> float:
    """``check_seconds`` where a wait must be given (``None`` refused too)."""
    wait = check_seconds(what, value)
    if wait is None:
        raise InvalidInput(what, "must be a number of seconds, not None")
    return wait


def check_backoff(attempts: object, **waits: object) -> None:
    """A schedule of attempts (``Retry``, ``VerifyBudget``): ``attempts`` an integer, 1 or
    more, and each of ``waits`` a number, 0 or more (``check_wait``); else
    ``InvalidInput`` naming it, when the schedule is made: a NaN delay failed between
    two attempts, after the first had passed the gate."""
    if isinstance(attempts, bool) or not isinstance(attempts, int):
        raise InvalidInput("attempts", f"must be an integer, not {type(attempts).__name__}")
    if attempts < 1:
        raise InvalidInput("attempts", f"{attempts}: must be 1 or more")
    for what, wait in waits.items():
        check_wait(what, wait)


# what an id may not hold: control characters (NUL among them), DEL, lone surrogates
_UNUSABLE = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")


# what free text may not hold: the same, but newlines and tabs, and the C1 controls
# (U+0080-U+009F: U+009B is a CSI to some terminals)
_UNSTORABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def storable(text: object) -> bool:
    """Whether ``sanitise`` would give ``text`` back as it is (a check in C, no copy)."""
    return type(text) is str and len(text) <= MAX_REASON_CHARS and not _UNSTORABLE.search(text)


# Unicode's Bidi_Control property: the characters that only steer the direction of text
# (U+202E RIGHT-TO-LEFT OVERRIDE made "refund 0001 EUR" read "refund 1000 EUR")
_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
BIDI_CONTROLS = re.compile(f"[{_BIDI}]")


# what an id being made may not hold besides (``check_new_id``): C1 controls, and the
# bidirectional controls
_NOT_NEW = re.compile(f"[\x80-\x9f{_BIDI}]")


def bidi_name(char: str) -> str:
    return f"<U+{ord(char):04X}>"


def with_bidi_shown(text: str) -> str:
    """``text`` with each bidirectional control written as its code point, ``<U+202E>``:
    stored text as every surface shows it, reading in its stored order (ADR 0070)."""
    return BIDI_CONTROLS.sub(lambda match: bidi_name(match[0]), text)


def shown_whole(value: object) -> str:
    """``value`` as a reader's screen shows it, whole: ``sanitise``'s control characters
    replaced, each bidirectional control written as its code point (a terminal's cells
    and lines, ADR 0051, ADR 0070)."""
    return with_bidi_shown(sanitise(value, at_most=None))


def replace_unusable(text: str, by: str) -> str:
    """``text`` with each character an id may not hold (``check_id``) replaced by ``by``."""
    return _UNUSABLE.sub(by, text)


def sanitise(text: object, *, at_most: int | None = MAX_REASON_CHARS) -> str:
    """Free text as every backend can store it and every terminal can print it: lone
    surrogates and control characters (but newlines and tabs; C1 too) replaced by
    U+FFFD, at most ``at_most`` characters (a longer text ends with "…").

    For text that describes and is never looked up: a cancel's reason (never a
    reason to refuse the cancel: its fence always commits), an operation's
    description, an error's message, evidence (a provider's answer, a server's
    message). A NUL there failed PostgreSQL's write, a lone surrogate every
    write, after the call had gone out; a 1 GB message was written whole."""
    text = str(text)
    if at_most is not None and len(text) > at_most:  # ``None``: shown whole (a terminal)
        text = text[: at_most - 1] + "\u2026"
    return _UNSTORABLE.sub("\ufffd", text)


# ids stopline derives: an id made elsewhere containing either is never used as it is
_DERIVED = re.compile("#sha256:|@run:")
_DIGEST = "#sha256:"


def fitted(text: str, room: int) -> str:
    """An id made elsewhere (an engine's, a child run's) as (part of) a stopline id of at
    most ``room`` characters.

    ``text`` itself when it fits, holds no control character and no marker of a
    derived id; else its printable start and the SHA-256 of all of it
    (``HEAD#sha256:HEX``): stable across processes, and never equal to an id
    used as itself, nor (but for a SHA-256 collision) to another derived one.
    """
    try:
        check_id("id", text)
        usable = len(text) <= room and _DERIVED.search(text) is None
    except InvalidInput:
        usable = False
    if usable:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    head = replace_unusable(text, "?")[: max(room - len(_DIGEST) - len(digest), 0)]
    return f"{head}{_DIGEST}{digest}"
