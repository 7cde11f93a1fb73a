"""What ``stopline check-mcp`` found, as values, as text and as JSON, and its exit code.

A profile is evidence, never a guess: each cell records what the server did
(its answer, a late answer, the effects its read tool reports) and the
receipt stopline itself gave, from a real run on a scratch ledger.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from stopline.domain.limits import sanitise

__all__ = ["CELLS", "CancelStops", "Cell", "Exit", "Profile", "ToolProfile", "render_text"]

CELLS: tuple[str, ...] = ("before_dispatch", "after_acceptance", "during", "after_result")
"""The barrier matrix: where the cancel lands relative to the request."""

_REVIEW = ("unknown", "needs_review")


class Exit(enum.IntEnum):
    """``stopline check-mcp`` exit codes (docs/check-mcp.md)."""

    OK = 0  # every checked tool has a provable cancellation profile (or read-only: no findings)
    FINDINGS = 1  # a cell ends "human review", a cancel the server cannot prove, a double effect
    ERROR = 2  # bad plan, no connection, a tool the plan names that the server lacks


class CancelStops(enum.StrEnum):
    """ "cancel stops it", from the cells whose cancel landed while the call was in flight
    (docs/check-mcp.md): only evidence says yes."""

    YES = "yes"  # every such cell proven without effect (ledger, confirmed cancel, ended, horizon)
    NO = "no"  # an effect was found in such a cell
    NOT_PROVEN = "not proven"  # no effect seen, nothing proves none will land (R13)
    UNKNOWN = "unknown"  # the effects could not be counted
    NOT_TESTED = "not tested"  # no cancel landed while a call was in flight


@dataclasses.dataclass
class Cell:
    name: str
    status: str = ""  # the operation's status in stopline's ledger once settled ("" if none)
    headline: str = ""  # the receipt's headline and message
    message: str = ""
    effects: int | None = None  # what the read shows at the last read (None: it cannot tell)
    late_answer: bool = False  # an answer arrived after the cancel
    signals: int = 0  # progress notifications and acceptances seen during the call
    note: str = ""
    key: str = ""  # the operation's id: its idempotency key ("" if nothing was sent)
    answered_first: bool = False  # the call's own answer came before the cancel
    not_sent: bool = False  # the cancel came before the request was written
    lost: bool = False  # the call's answer was lost: stopline had to find out
    settled_by_read: bool = False  # ... and a read-back settled it
    proof: str = ""  # what proves "no effect" (empty: nothing does)
    seen_after: float | None = None  # seconds from the cancel to the last read
    timeout: str = ""  # a wait that ran out, and which
    ended: bool = dataclasses.field(default=False, repr=False)  # the sandbox said it ended
    horizon: float | None = dataclasses.field(default=None, repr=False)  # R13, epoch seconds
    cancelled_at: float = dataclasses.field(default=0.0, repr=False)  # epoch seconds, 0: none

    @property
    def in_flight(self) -> bool:
        """The cancel landed while the call was in flight: only such a cell can say
        whether a cancel stops the tool."""
        return (
            bool(self.cancelled_at and self.key) and not self.answered_first and not self.not_sent
        )

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for internal in ("ended", "horizon", "cancelled_at"):
            del out[internal]
        return out


@dataclasses.dataclass
class ToolProfile:
    name: str
    declared: dict[str, Any]
    cells: list[Cell] = dataclasses.field(default_factory=list)
    repeat_effects: int | None = None  # effects after two calls with one key
    repeat_answered: bool = True  # both of those calls answered (else nothing is proven)
    read: str = ""  # how outcomes are read back: "stopline_verify", the plan's tool, or ""
    progress: int = 0  # progress notifications seen during the calls
    timeouts: list[str] = dataclasses.field(default_factory=list)  # waits that ran out
    findings: list[str] = dataclasses.field(default_factory=list)

    def cell(self, name: str) -> Cell | None:
        return next((c for c in self.cells if c.name == name), None)

    @property
    def cancel_stops(self) -> CancelStops:
        tested = [c for c in self.cells if c.in_flight]
        if not tested:
            return CancelStops.NOT_TESTED
        if any(c.effects for c in tested):
            return CancelStops.NO
        if any(c.effects is None for c in tested):
            return CancelStops.UNKNOWN
        return CancelStops.YES if all(c.proof for c in tested) else CancelStops.NOT_PROVEN

    @property
    def cancel_stops_detail(self) -> str:
        """``cancel_stops`` with the evidence it rests on, as the report words it."""
        verdict = self.cancel_stops
        tested = [c for c in self.cells if c.in_flight]
        if verdict is CancelStops.YES:
            return f"yes ({'; '.join(sorted({c.proof for c in tested}))})"
        if verdict is CancelStops.NO:
            where = ", ".join(c.name for c in tested if c.effects)
            return f"no (an effect after a cancel in flight: {where})"
        if verdict is CancelStops.NOT_PROVEN:
            seen = min(c.seen_after or 0.0 for c in tested if not c.proof)
            return f"not proven (no effect seen {seen:.0f} s after the cancel; not proof)"
        if verdict is CancelStops.UNKNOWN:
            return "unknown (the effects after a cancel could not be counted)"
        return "not tested (no cancel landed while a call was in flight)"

    @property
    def answers_after_cancel(self) -> str:
        return "yes" if any(c.late_answer for c in self.cells) else "no"

    @property
    def idempotent_by_key(self) -> str:
        if self.repeat_effects is None:
            return "unknown"
        if self.repeat_effects > 1:
            return "no (two effects)"
        if not self.repeat_answered:  # one may still land: seen so far proves nothing
            return f"not proven (a call got no answer; {self.repeat_effects} effect(s) seen)"
        if self.repeat_effects == 0:
            return "not proven (no effect seen: the calls did nothing to compare)"
        return "yes (one effect)"

    @property
    def read_settles(self) -> str:
        """Whether the read settled the cells whose answer was lost (and nothing else did)."""
        if not self.read:
            return "no read tool"
        tested = [c for c in self.cells if c.lost and (c.settled_by_read or c.status in _REVIEW)]
        if not tested:
            return "not tested (no cell was left unknown)"
        settled = sum(1 for c in tested if c.settled_by_read)
        return "yes" if settled == len(tested) else "partly" if settled else "no"

    def findings_review(self) -> list[Cell]:
        return [c for c in self.cells if c.status in _REVIEW]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "declared": self.declared,
            "read": self.read,
            "progress_notifications": self.progress,
            "cancel_stops": self.cancel_stops.value,
            "cancel_stops_detail": self.cancel_stops_detail,
            "answers_after_cancel": self.answers_after_cancel,
            "idempotent_by_key": self.idempotent_by_key,
            "read_settles_unknown": self.read_settles,
            "repeat_effects": self.repeat_effects,
            "repeat_answered": self.repeat_answered,
            "cells": [c.to_json() for c in self.cells],
            "findings": self.findings,
        }


@dataclasses.dataclass
class Profile:
    target: str
    protocol_version: str = ""
    server: str = ""
    tasks: str = "no"
    verify_tool: bool = False
    tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    checked: list[ToolProfile] = dataclasses.field(default_factory=list)
    findings: list[str] = dataclasses.field(default_factory=list)

    @property
    def exit(self) -> Exit:
        if self.findings or any(t.findings for t in self.checked):
            return Exit.FINDINGS
        return Exit.OK

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "protocol_version": self.protocol_version,
            "server": self.server,
            "tasks": self.tasks,
            "stopline_verify": self.verify_tool,
            "tools": self.tools,
            "checked": [t.to_json() for t in self.checked],
            "findings": self.findings,
            "exit": int(self.exit),
        }


def _one_line(value: object) -> str:
    """Server-supplied text as one printable token: control characters replaced
    (``sanitise``), and a text that would break a line shown quoted, its breaks escaped."""
    text = sanitise(value, at_most=None)
    return json.dumps(text, ensure_ascii=False) if "\n" in text or "\t" in text else text


def _yn(value: Any) -> str:
    return (
        "-"
        if value is None
        else ("yes" if value is True else "no" if value is False else _one_line(value))
    )


def render_text(profile: Profile) -> str:
    """The report a person reads (the JSON carries the same facts)."""
    out = [
        f"server      {_one_line(profile.server) or '(anonymous)'} ({profile.target})",
        f"protocol    {_one_line(profile.protocol_version)}",
        f"tasks       {profile.tasks}",
        f"read-back   {'stopline_verify' if profile.verify_tool else 'none offered'}",
        "",
        "tools (declared)        readOnly  idempotent  effects  cancellable     task",
    ]
    ignored = []
    for tool in profile.tools:
        name, skip = _one_line(tool["name"]), tool.get("ignored") or {}
        effects = "ignored" if "io.stopline/effects" in skip else _yn(tool.get("effects"))
        cancel = "ignored" if "io.stopline/cancellable" in skip else _yn(tool.get("cancellable"))
        out.append(
            f"  {name:<21} {_yn(tool.get('readOnlyHint')):<10}"
            f"{_yn(tool.get('idempotentHint')):<12}{effects:<9}"
            f"{cancel:<16}{_yn(tool.get('taskSupport'))}"
        )
        ignored += [
            f"  {name}: _meta {k} = {_one_line(json.dumps(v))} is not in stopline's vocabulary:"
            " ignored (the safe default applies)"
            for k, v in skip.items()
        ]
    out += ignored
    for checked in profile.checked:
        out += [
            "",
            f"{_one_line(checked.name)}: read-back via {_one_line(checked.read) or 'nothing'}, "
            f"{checked.progress} progress notification(s)",
            f"  cancel stops it: {checked.cancel_stops_detail}; answers after a cancel: "
            f"{checked.answers_after_cancel}; same key twice: {checked.idempotent_by_key}; "
            f"read settles an unknown: {checked.read_settles}",
            "  cell               effects  late  status          receipt",
        ]
        for cell in checked.cells:
            effects = "?" if cell.effects is None else str(cell.effects)
            out.append(
                f"  {cell.name:<19}{effects:<9}{'yes' if cell.late_answer else 'no':<6}"
                f"{cell.status or '-':<16}{cell.message or cell.note}"
            )
            if cell.message and cell.note:
                out.append(f"  {'':<19}{'':<9}{'':<6}{'':<16}({cell.note})")
        out += [f"  ! {_one_line(finding)}" for finding in checked.findings]
    out += [f"! {_one_line(finding)}" for finding in profile.findings]
    verdict = {
        Exit.OK: "no findings",
        Exit.FINDINGS: "findings (exit 1)",
        Exit.ERROR: "error (exit 2)",
    }[profile.exit]
    out += ["", f"result: {verdict}"]
    return "\n".join(out)
