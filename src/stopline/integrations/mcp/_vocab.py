"""The wire vocabulary stopline adds to MCP, written down once.

Every name below travels in a ``_meta`` object (request, tool listing or
result) or names a tool, so a server and a client built from different
versions of stopline agree on what they read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from stopline.domain.vocab import Cancellable
from stopline.errors import InvalidInput

__all__ = [
    "ACCEPTED_MESSAGE",
    "CANCELLABLE_META",
    "EFFECTS_META",
    "KEY_META",
    "MAX_VERIFY_WAIT",
    "OUTCOME_DATA",
    "REJECTED_CODE",
    "TASKS_EXTENSION",
    "TRACKED_META",
    "VERIFY_TOOL",
    "ToolPolicy",
    "check_verify_wait",
    "policy_from_listing",
]

KEY_META = "io.stopline/key"
"""Request ``_meta`` key carrying the operation id, which is the idempotency key."""

EFFECTS_META = "io.stopline/effects"
"""Tool ``_meta``: ``true`` when calling the tool changes the world, ``false`` for a read."""

CANCELLABLE_META = "io.stopline/cancellable"
"""Tool ``_meta``: ``until_accepted``, ``after_accepted`` or ``never`` (``Cancellable``)."""

TRACKED_META = "io.stopline/tracked"
"""Tool ``_meta``: ``true`` when the server records every call of the tool by key (through
``Effects``), so that ``stopline_verify``'s "no record of the key" proves "not committed"
for it (ADR 0063). Absent or anything else: its absence of a record proves nothing."""

ACCEPTED_MESSAGE = "io.stopline/accepted"
"""The ``message`` of the progress notification a server sends when it accepts a request."""

VERIFY_TOOL = "stopline_verify"
"""The standard read-only tool reporting an operation's status by key."""

MAX_VERIFY_WAIT = 30.0
"""The longest ``wait_seconds`` a ``stopline_verify`` long poll may ask for."""

OUTCOME_DATA = "io.stopline/outcome"
"""Key in a JSON-RPC error's ``data``: ``not_committed`` proves the request had no effect."""

REJECTED_CODE = -32090
"""JSON-RPC error code a stopline server uses for "refused before any effect"."""

TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
"""The MCP tasks extension (2026-07-28) identifier."""


@dataclasses.dataclass(frozen=True, slots=True)
class ToolPolicy:
    """How the client treats one MCP tool: what it declares and what we override.

    ``None`` fields fall back to what the server's listing says, then to the
    safe default (effects: yes; cancellable: until accepted).
    """

    effects: bool | None = None
    cancellable: Cancellable | None = None
    verify: bool | None = None  # use the server's stopline_verify (default: when offered)
    # the server records every call of the tool by key, so stopline_verify's "no record"
    # proves "not committed" (default: as its listing declares, io.stopline/tracked; ADR 0063)
    tracked: bool | None = None
    task: bool = False  # 2025-11-25: ask for a task (params.task); in 2026 the server decides
    key_argument: str | None = None  # also pass the key as this argument
    # R13: seconds after dispatch by which the server's effect has landed or never will
    settles_within: float | None = None

    def merged(self, base: ToolPolicy) -> ToolPolicy:
        """This override applied over ``base``."""
        return ToolPolicy(
            effects=self.effects if self.effects is not None else base.effects,
            cancellable=self.cancellable if self.cancellable is not None else base.cancellable,
            verify=self.verify if self.verify is not None else base.verify,
            tracked=self.tracked if self.tracked is not None else base.tracked,
            task=self.task or base.task,
            key_argument=self.key_argument or base.key_argument,
            settles_within=(
                self.settles_within if self.settles_within is not None else base.settles_within
            ),
        )


def policy_from_listing(
    meta: Mapping[str, Any] | None,
    read_only_hint: bool | None,
    *,
    trust_read_hints: bool = False,
) -> ToolPolicy:
    """What a tool listing declares: ``_meta`` first, then the standard annotations.

    ``readOnlyHint: true`` means no effects only with ``trust_read_hints`` (a foreign
    server's hint is untrusted: alone it never takes a call past the gate, ADR 0055). A
    ``_meta`` value that is not part of the vocabulary is ignored (the safe default
    applies), never guessed at.
    """
    meta = meta or {}
    effects: bool | None = None
    raw = meta.get(EFFECTS_META)
    if isinstance(raw, bool):
        effects = raw
    elif read_only_hint is True and trust_read_hints:
        effects = False
    cancellable: Cancellable | None = None
    raw_cancel = meta.get(CANCELLABLE_META)
    if isinstance(raw_cancel, str) and raw_cancel in Cancellable.__members__.values():
        cancellable = Cancellable(raw_cancel)
    tracked = True if meta.get(TRACKED_META) is True else None
    return ToolPolicy(effects=effects, cancellable=cancellable, tracked=tracked)


def check_verify_wait(value: object) -> float:
    """A ``stopline_verify`` long poll's ``wait_seconds``: a number from 0 to
    ``MAX_VERIFY_WAIT``, else ``InvalidInput`` naming the problem (before, -1 was read as
    0 and 1e9 as 30 s, silently)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(
            "wait_seconds", f"must be a number of seconds, not {type(value).__name__}"
        )
    if not 0 <= value <= MAX_VERIFY_WAIT:  # NaN too
        raise InvalidInput("wait_seconds", f"{value}: must be 0 to {MAX_VERIFY_WAIT:g} seconds")
    return float(value)
