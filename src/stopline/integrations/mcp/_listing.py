"""A server's tool listing as the client reads it: one declaration per name.

A listing may name one tool more than once (a proxy that merges servers, a
server's bug). Which copy the server runs when the name is called cannot be
known, so no copy may weaken the gate: the client keeps one entry per name,
the first copy carrying the most conservative declaration of them all.

- ``io.stopline/effects`` is ``false`` (a read, sent without the gate) only
  when every copy says ``false``; when every copy declares it, it is
  ``true`` otherwise; when a copy declares nothing, it is dropped, which
  leaves the safe default (effectful) and no claim that the server reads the
  idempotency key (a re-issue relies on that claim);
- ``io.stopline/cancellable`` is the least cancellable copy's (``never``,
  then ``until_accepted``, the default, then ``after_accepted``);
- ``readOnlyHint`` is ``true`` only when every copy says so.

A client-side ``ToolPolicy`` still overrides the result.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from mcp_types import Tool as McpTool

from stopline.domain.vocab import Cancellable
from stopline.integrations.mcp._vocab import CANCELLABLE_META, EFFECTS_META

__all__ = ["conservative", "index_tools"]

logger = logging.getLogger(__name__)

# least cancellable first: a conflict takes the first of these any copy declares
_LEAST_CANCELLABLE = (Cancellable.NEVER, Cancellable.UNTIL_ACCEPTED, Cancellable.AFTER_ACCEPTED)


def index_tools(tools: Iterable[McpTool]) -> dict[str, McpTool]:
    """The listing by name; a name listed more than once gets ``conservative`` copies."""
    copies: dict[str, list[McpTool]] = {}
    for tool in tools:
        copies.setdefault(tool.name, []).append(tool)
    out: dict[str, McpTool] = {}
    for name, same in copies.items():
        out[name] = same[0] if len(same) == 1 else conservative(same)
        if len({t.model_dump_json() for t in same}) > 1:
            logger.warning(
                "stopline: the MCP server lists tool %r %d times with different declarations;"
                " the most conservative is used",
                name,
                len(same),
            )
    return out


def _cancellable(raw: object) -> Cancellable:
    if isinstance(raw, str) and raw in Cancellable.__members__.values():
        return Cancellable(raw)
    return Cancellable.UNTIL_ACCEPTED  # what no declaration means


def conservative(copies: Sequence[McpTool]) -> McpTool:
    """The first copy, declaring what the most conservative copy declares."""
    first = copies[0]
    metas = [c.meta or {} for c in copies]
    meta = dict(first.meta or {})
    effects = [m.get(EFFECTS_META) for m in metas]
    if all(isinstance(v, bool) for v in effects):
        meta[EFFECTS_META] = not all(v is False for v in effects)
    else:  # a copy declares nothing: the safe default, and no claim about the key
        meta.pop(EFFECTS_META, None)
    if any(CANCELLABLE_META in m for m in metas):
        least = min(
            (_cancellable(m.get(CANCELLABLE_META)) for m in metas), key=_LEAST_CANCELLABLE.index
        )
        meta[CANCELLABLE_META] = least.value
    annotations = first.annotations
    hints = [c.annotations.read_only_hint if c.annotations else None for c in copies]
    if annotations is not None and not all(h is True for h in hints):
        annotations = annotations.model_copy(update={"read_only_hint": False})
    return first.model_copy(update={"meta": meta or None, "annotations": annotations})
