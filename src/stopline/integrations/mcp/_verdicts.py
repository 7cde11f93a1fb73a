"""What a ``stopline_verify`` answer proves, written once for both ends (ADR 0063).

A server's record (``Effects``) holds the keys its tools recorded through
``effects.operation`` and ``effects.run_sync``, and no others. So "no record of the
key" proves "not committed" only for a tool that records every call reaching it:
one whose listing declares ``_meta["io.stopline/tracked"]: true`` (``effect_meta``
does). For any other tool (one that declares only ``io.stopline/effects``, a read, a
tool the server does not list) it proves nothing: the tool may have run and left no
trace in the record, and the answer is ``unknown``.

- **Server** (``untracked``, ``answer``): the verify names the tool the key was sent
  to (``tool``); the answer says whether the server tracks it (``tracked``) and says
  ``not_committed`` for a key it has no record of only then. A verify that names no
  tool (a client from before ADR 0063) gets ``not_committed`` only when the server
  tracks every tool that may have effects. A tracked tool seen answering a call
  without recording it (its declaration is false) is tracked no more in that
  process, and that key is marked as answered unrecorded: ``unknown``. So is the key
  of a call whose body may have run and that recorded nothing (it failed, was
  cancelled, or its process ended), and a key a call is still bringing, in any server
  process on the file, is in flight (``_tracking``, ADR 0067).
- **Client** (``proves``): a ``not_committed`` for a key the server has no record of
  is believed only when the answer says the named tool is tracked; from a server
  that does not say (before ADR 0063), only when the client itself declares the tool
  tracked (``ToolPolicy(tracked=True)``). A verdict read from a record stands.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from mcp_types import Tool as McpTool

from stopline.integrations.mcp._store import EffectRecord, EffectState, Ending, Unrecorded
from stopline.integrations.mcp._vocab import EFFECTS_META, TRACKED_META
from stopline.runtime.tool import Verdict

__all__ = [
    "UNSEEN",
    "answer",
    "declares_tracked",
    "pending_detail",
    "proves",
    "takes_tool",
    "untracked",
]

UNSEEN = "unknown_key"
"""The ``state`` of an answer for a key the server has no record of."""


# -- the server --------------------------------------------------------------------------------
def untracked(listing: Iterable[McpTool], tool: str | None, demoted: Collection[str]) -> str | None:
    """Why "no record" proves nothing for ``tool`` (for every tool that may have effects,
    when ``None``); ``None`` when it proves "not committed"."""
    tools = {t.name: t for t in listing}
    if tool is not None:
        listed = tools.get(tool)
        return f"this server lists no tool {tool!r}" if listed is None else _why(listed, demoted)
    for listed in tools.values():
        may_act = (listed.meta or {}).get(EFFECTS_META) is not False
        why = _why(listed, demoted) if may_act else None
        if why is not None:
            return f"{why}, and the verify named no tool"
    return None


def declares_tracked(listed: McpTool) -> bool:
    """Whether a listed tool promises that every call of it is recorded by key."""
    return (listed.meta or {}).get(TRACKED_META) is True


def _why(listed: McpTool, demoted: Collection[str]) -> str | None:
    if not declares_tracked(listed):
        return f"this server does not record calls of tool {listed.name!r} by key"
    if listed.name in demoted:
        return f"tool {listed.name!r} declares {TRACKED_META} but answered a call unrecorded"
    return None


_ENDINGS = {
    Ending.ANSWERED: "answered this key without recording it",
    Ending.FAILED: "ran with this key and ended without a result, recording nothing",
    Ending.CANCELLED: "was cancelled with this key once it may have run, recording nothing",
    Ending.ENDED: "was running with this key when its server process ended, recording nothing",
}


def answer(
    key: str,
    record: EffectRecord | None,
    *,
    in_flight: bool,
    tool: str | None,
    why_untracked: str | None,
    unrecorded: Unrecorded | None,
) -> dict[str, Any]:
    """The ``stopline_verify`` answer: from the record when there is one; else
    ``not_committed`` only where the server would have recorded the key and no call
    with it is on its way or left no record."""
    tracked = why_untracked is None and unrecorded is None
    out: dict[str, Any]
    if record is None:
        state, verdict = (UNSEEN, "not_committed") if tracked else (UNSEEN, "unknown")
        if in_flight:
            state, verdict, detail = "in_progress", "unknown", "received, nothing recorded yet"
        elif unrecorded is not None:
            detail = f"tool {unrecorded.tool!r} {_ENDINGS[unrecorded.ending]}"
        elif tracked:
            detail = "this server never saw the key"
        else:
            detail = f"no record of the key, which proves nothing: {why_untracked}"
        out = {"key": key, "state": state, "verdict": verdict, "detail": detail, "cancel": "none"}
    else:
        out = {
            "key": key,
            "state": record.state.value,
            "verdict": {
                EffectState.COMMITTED: "committed",
                EffectState.NOT_COMMITTED: "not_committed",
            }.get(record.state, "unknown"),
            "detail": record.detail if record.state.terminal else pending_detail(record),
            "cancel": record.cancel,
            "updated_at": record.updated_at,
        }
        if record.state is EffectState.COMMITTED:
            out["result"] = record.result
    out["tracked"] = tracked
    if tool is not None:
        out["tool"] = tool
    return out


def pending_detail(record: EffectRecord) -> str:
    if record.detail:
        return record.detail
    if record.state is EffectState.COMMITTING:
        return "its commit began; no outcome is recorded yet"
    return "in progress"


# -- the client --------------------------------------------------------------------------------
def takes_tool(verify: McpTool | None) -> bool:
    """Whether a server's listed ``stopline_verify`` takes the tool a key was sent to (its
    input schema names ``tool``: ADR 0063); one from before takes the key alone."""
    takes = verify.input_schema.get("properties") if verify is not None else None
    return isinstance(takes, dict) and "tool" in takes


def proves(status: Mapping[str, Any], tool: str, declared: bool | None) -> tuple[Verdict, str]:
    """What the answer for a key sent to ``tool`` proves; ``declared`` is the client's
    ``ToolPolicy.tracked`` for it (the listing's ``io.stopline/tracked``, or its override)."""
    detail = str(status.get("detail") or status.get("state") or "")
    try:
        verdict = Verdict(status.get("verdict", "unknown"))
    except ValueError:
        return Verdict.UNKNOWN, f"an answer with no verdict: {status.get('verdict')!r}"
    if verdict is Verdict.NOT_COMMITTED and status.get("state") == UNSEEN:
        if "tracked" in status:  # a server that says whether it records the tool (ADR 0063)
            named = status.get("tool") == tool
            believed = status["tracked"] is True and named and declared is not False
        else:  # a server from before: its "never saw the key" holds for tracked tools only
            believed = declared is True
        if not believed:
            why = f"the server does not say it records every call of {tool!r}"
            return Verdict.UNKNOWN, f"{detail}; no record proves nothing: {why}"
    return verdict, detail
