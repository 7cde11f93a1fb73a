"""What ``stopline check-mcp`` found, as values, as text and as JSON, and its exit code.

A profile is evidence, never a guess: each cell records what the server did
(its answer, a late answer, the effects its read tool reports) and the
receipt stopline itself gave, from a real run on a scratch ledger.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = ["CELLS", "Cell", "Exit", "Profile", "ToolProfile", "render_text"]

CELLS: tuple[str, ...] = ("before_dispatch", "after_acceptance", "during", "after_result")
"""The barrier matrix: where the cancel lands relative to the request."""


class Exit(enum.IntEnum):
    """``stopline check-mcp`` exit codes (docs/check-mcp.md)."""

    OK = 0  # every checked tool has a provable cancellation profile (or read-only: no findings)
    FINDINGS = 1  # a cell ends "human review", a cancel the server cannot prove, a double effect
    ERROR = 2  # bad plan, no connection, a tool the plan names that the server lacks


@dataclasses.dataclass
class Cell:
    name: str
    status: str = ""  # the operation's status in stopline's ledger once settled ("" if none)
    headline: str = ""  # the receipt's headline and message
    message: str = ""
    effects: int | None = None  # what the read tool reports afterwards (None: no read tool)
    late_answer: bool = False  # an answer arrived after the cancel
    signals: int = 0  # progress notifications and acceptances seen during the call
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ToolProfile:
    name: str
    declared: dict[str, Any]
    cells: list[Cell] = dataclasses.field(default_factory=list)
    repeat_effects: int | None = None  # effects after two calls with one key
    read: str = ""  # how outcomes are read back: "stopline_verify", the plan's tool, or ""
    progress: int = 0  # progress notifications seen during the calls
    findings: list[str] = dataclasses.field(default_factory=list)

    def cell(self, name: str) -> Cell | None:
        return next((c for c in self.cells if c.name == name), None)

    @property
    def cancel_stops(self) -> str:
        during = self.cell("during")
        if during is None or during.effects is None:
            return "unknown"
        return "yes" if during.effects == 0 else "no"

    @property
    def answers_after_cancel(self) -> str:
        return "yes" if any(c.late_answer for c in self.cells) else "no"

    @property
    def idempotent_by_key(self) -> str:
        if self.repeat_effects is None:
            return "unknown"
        return "yes (one effect)" if self.repeat_effects <= 1 else "no (two effects)"

    @property
    def read_settles(self) -> str:
        if not self.read:
            return "no read tool"
        settled = [c for c in self.cells if c.status in ("committed", "not_committed")]
        return "yes" if settled and not self.findings_review() else "partly"

    def findings_review(self) -> list[Cell]:
        return [c for c in self.cells if c.status in ("unknown", "needs_review")]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "declared": self.declared,
            "read": self.read,
            "progress_notifications": self.progress,
            "cancel_stops": self.cancel_stops,
            "answers_after_cancel": self.answers_after_cancel,
            "idempotent_by_key": self.idempotent_by_key,
            "read_settles_unknown": self.read_settles,
            "repeat_effects": self.repeat_effects,
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


def _yn(value: Any) -> str:
    return (
        "-"
        if value is None
        else ("yes" if value is True else "no" if value is False else str(value))
    )


def render_text(profile: Profile) -> str:
    """The report a person reads (the JSON carries the same facts)."""
    out = [
        f"server      {profile.server or '(anonymous)'} ({profile.target})",
        f"protocol    {profile.protocol_version}",
        f"tasks       {profile.tasks}",
        f"read-back   {'stopline_verify' if profile.verify_tool else 'none offered'}",
        "",
        "tools (declared)        readOnly  idempotent  effects  cancellable     task",
    ]
    for tool in profile.tools:
        out.append(
            f"  {tool['name']:<22}{_yn(tool.get('readOnlyHint')):<10}"
            f"{_yn(tool.get('idempotentHint')):<12}{_yn(tool.get('effects')):<9}"
            f"{_yn(tool.get('cancellable')):<16}{_yn(tool.get('taskSupport'))}"
        )
    for checked in profile.checked:
        out += [
            "",
            f"{checked.name}: read-back via {checked.read or 'nothing'}, "
            f"{checked.progress} progress notification(s)",
            f"  cancel stops it: {checked.cancel_stops}; answers after a cancel: "
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
        out += [f"  ! {finding}" for finding in checked.findings]
    out += [f"! {finding}" for finding in profile.findings]
    verdict = {
        Exit.OK: "no findings",
        Exit.FINDINGS: "findings (exit 1)",
        Exit.ERROR: "error (exit 2)",
    }[profile.exit]
    out += ["", f"result: {verdict}"]
    return "\n".join(out)
