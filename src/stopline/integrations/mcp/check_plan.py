"""A ``stopline check-mcp`` plan: the tools it may call, their arguments, where the
idempotency key goes, the read tool that shows their effects and a sandbox's barrier.

``"{key}"`` anywhere in an argument (the tool's, its read tool's, a control call's)
is the call's idempotency key: ``with_key`` is the one substitution every call uses.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stopline.errors import PlanError

__all__ = ["Call", "Plan", "PlanError", "ToolPlan", "load_plan", "with_key"]


@dataclasses.dataclass(frozen=True)
class Call:
    tool: str
    arguments: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    name: str
    arguments: Mapping[str, Any]
    key_argument: str | None = None
    read: Call | None = None
    read_path: tuple[str, bool] | None = None  # (dotted path, is a count)
    hold: Mapping[str, Call] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Plan:
    tools: Mapping[str, ToolPlan]


def _call(raw: Any, where: str) -> Call:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("tool"), str):
        raise PlanError(f"{where}: expected {{'tool': NAME, 'arguments': {{...}}}}")
    args = raw.get("arguments", {})
    if not isinstance(args, Mapping):
        raise PlanError(f"{where}.arguments: expected a table of arguments")
    return Call(raw["tool"], dict(args))


def load_plan(path: Path) -> Plan:
    """Read a plan (``.toml`` or JSON); ``PlanError`` names the first problem."""
    try:
        text = path.read_text()
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read the plan {path}: {exc}") from exc
    tools = raw.get("tools") if isinstance(raw, Mapping) else None
    if not isinstance(tools, Mapping) or not tools:
        raise PlanError(f"{path}: expected a 'tools' table naming at least one tool")
    out: dict[str, ToolPlan] = {}
    for name, spec in tools.items():
        where = f"tools.{name}"
        if not isinstance(spec, Mapping):
            raise PlanError(f"{where}: expected a table")
        args = spec.get("arguments", {})
        key_argument = spec.get("key_argument")
        if not isinstance(args, Mapping) or not isinstance(key_argument, str | None):
            raise PlanError(f"{where}: 'arguments' must be a table, 'key_argument' a string")
        read, read_path = None, None
        if "read" in spec:
            read = _call(spec["read"], f"{where}.read")
            count, found = spec["read"].get("count"), spec["read"].get("found")
            if not isinstance(count or found, str):
                raise PlanError(f"{where}.read: name the result's 'count' or 'found' field")
            read_path = (str(count or found), count is not None)
        hold = {k: _call(v, f"{where}.hold.{k}") for k, v in (spec.get("hold") or {}).items()}
        if hold and not {"before", "release"} <= set(hold):
            raise PlanError(f"{where}.hold: needs at least 'before' and 'release'")
        out[name] = ToolPlan(name, dict(args), key_argument, read, read_path, hold)
    return Plan(out)


def with_key(value: Any, key: str) -> Any:
    """``value`` with every ``"{key}"`` in its strings replaced by ``key``."""
    if isinstance(value, str):
        return value.replace("{key}", key)
    if isinstance(value, Mapping):
        return {k: with_key(v, key) for k, v in value.items()}
    if isinstance(value, list):
        return [with_key(v, key) for v in value]
    return value
