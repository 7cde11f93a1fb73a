"""`stopline map MODULE`: the phases and tools of a workflow module, and their gaps.

Tools are the ``stopline.Tool`` objects found at module level (also those
held as ``.tool`` by a module-level object, such as a provider). Phases come
from a module-level ``PHASES`` sequence (``PhaseKind`` or ``(PhaseKind,
Policy)`` pairs) when there is one, else from the ``PhaseKind.NAME`` the
module's source mentions, with their default policies.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

import typer

from stopline.cli import _common as c
from stopline.cli._layout import Grid
from stopline.cli.views import UsageError
from stopline.domain.vocab import Cancellable, PhaseKind, Policy
from stopline.runtime.tool import Tool

__all__ = ["ModuleMap", "map_module", "register"]

_POLICY_WORDS = {
    Policy.IMMEDIATE: "at once: cancel interrupts it",
    Policy.AT_BOUNDARY: "at the next boundary: the current step finishes",
    Policy.VERIFY: "only after verification: what happened is proven first",
}
_PHASE_REF = re.compile(r"PhaseKind\.([A-Z_]+)")


@dataclasses.dataclass(frozen=True, slots=True)
class ToolInfo:
    name: str
    description: str
    effects: bool
    cancellable: Cancellable
    can_cancel: bool
    has_verifier: bool
    has_compensator: bool

    @property
    def stop(self) -> str:
        """How a cancel reaches a call of this tool in flight."""
        if not self.effects:
            return "at once (read-only)"
        if self.can_cancel and self.cancellable is Cancellable.AFTER_ACCEPTED:
            return "at once: the provider cancels even after acceptance"
        verified = "verification" if self.has_verifier else "human review"
        if self.can_cancel and self.cancellable is Cancellable.UNTIL_ACCEPTED:
            return f"provider cancel until accepted; then only after {verified}"
        return f"only after {verified}"

    @property
    def gaps(self) -> list[str]:
        if not self.effects:
            return []
        out = []
        if not self.has_verifier:
            out.append("no verifier: an unknown outcome goes to human review")
        if not self.has_compensator:
            out.append("no compensator: a committed action cannot be corrected")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "effects": self.effects,
            "cancellable": self.cancellable.value,
            "can_cancel": self.can_cancel,
            "has_verifier": self.has_verifier,
            "has_compensator": self.has_compensator,
            "stop": self.stop,
            "gaps": self.gaps,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class ModuleMap:
    module: str
    phases: list[tuple[PhaseKind, Policy]]
    tools: list[ToolInfo]
    runtime: list[str] = dataclasses.field(default_factory=list)  # MCP connections: not mapped

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "phases": [
                {"phase": k.value, "policy": p.value, "stop": _POLICY_WORDS[p]}
                for k, p in self.phases
            ],
            "tools": [t.to_json() for t in self.tools],
            "gaps": [{"tool": t.name, "gap": g} for t in self.tools for g in t.gaps],
            "not_mapped": [
                {"name": n, "why": "MCP connection: tools known at run time"} for n in self.runtime
            ],
        }


def load_module(target: str) -> ModuleType:
    """A dotted module name (importable from the current directory) or a .py path."""
    path = Path(target)
    try:
        if target.endswith(".py") or path.is_file():
            if not path.is_file():
                raise UsageError(f"no such file: {target}")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            if spec is None or spec.loader is None:
                raise UsageError(f"cannot import {target}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            return module
        if "" not in sys.path:
            sys.path.insert(0, "")
        return importlib.import_module(target)
    except (ImportError, ValueError, TypeError) as exc:  # "" and ".x" are these two
        raise UsageError(f"cannot import {target}: {exc}") from exc
    except UsageError:
        raise
    except Exception as exc:  # the module's own failure: one line, where it happened
        raise UsageError(f"cannot import {target}: {_where(exc)}") from exc
    except SystemExit as exc:  # it ended the command with its own code, saying nothing
        raise UsageError(f"cannot import {target}: it called sys.exit({exc.code!r})") from exc


def _where(exc: Exception) -> str:
    """``exc`` as one line with the place it was raised (the module's last frame; a
    ``SyntaxError`` names its own line)."""
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{at}"


def _phases(module: ModuleType) -> list[tuple[PhaseKind, Policy]]:
    declared = getattr(module, "PHASES", None)
    if declared is not None:
        out = []
        for item in declared:
            if isinstance(item, PhaseKind):
                out.append((item, item.default_policy))
            else:
                kind, policy = item
                out.append((PhaseKind(kind), Policy(policy)))
        return out
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return []
    seen: dict[PhaseKind, Policy] = {}
    for name in _PHASE_REF.findall(source):
        kind = PhaseKind.__members__.get(name)
        if kind is not None:
            seen.setdefault(kind, kind.default_policy)
    return list(seen.items())


def map_module(module: ModuleType) -> ModuleMap:
    tools: dict[int, Tool[Any]] = {}
    for value in vars(module).values():
        for candidate in (value, getattr(value, "tool", None)):
            if isinstance(candidate, Tool):
                tools.setdefault(id(candidate), candidate)
    infos = [
        ToolInfo(
            name=t.name,
            description=t.description,
            effects=t.effects,
            cancellable=t.cancellable,
            can_cancel=t.cancel_fn is not None,
            has_verifier=t.verify_fn is not None,
            has_compensator=t.compensate_fn is not None,
        )
        for t in tools.values()
    ]
    infos.sort(key=lambda t: t.name)
    runtime = sorted(name for name, value in vars(module).items() if _runtime_tools(value))
    return ModuleMap(module.__name__, _phases(module), infos, runtime)


def _runtime_tools(value: object) -> bool:
    """An object whose tools exist only at run time (an MCP connection lists them when
    it connects): a map of the module cannot show them. Named by its class, so the map
    imports no integration."""
    kind = type(value)
    return kind.__name__ == "StoplineMCP" and kind.__module__.startswith("stopline.")


def map_command(
    module: Annotated[str, typer.Argument(help="A module (dotted name or .py path).")],
    strict: Annotated[bool, typer.Option(help="Exit 1 when an effectful tool has a gap.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The phases and tools of a workflow module: side effects, how cancel stops them, gaps."""
    result = map_module(load_module(module))
    has_gaps = any(t.gaps for t in result.tools)
    if as_json:
        c.print_json(result.to_json())
    else:
        _print(result)
    raise typer.Exit(c.EXIT_ERROR if strict and has_gaps else c.EXIT_OK)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _print(result: ModuleMap) -> None:
    c.out.print(result.module, style="bold")
    if result.phases:
        phases = Grid(("PHASE", "POLICY", "A CANCEL STOPS IT"), title="phases")
        for kind, policy in result.phases:
            phases.add_row(kind.value, policy.value, _POLICY_WORDS[policy])
        phases.print(c.out)
    tools = Grid(
        ("TOOL", "EFFECTS", "PROVIDER CANCEL", "VERIFIER", "COMPENSATOR", "STOPS"), title="tools"
    )
    for t in result.tools:
        cancel = t.cancellable.value if t.effects and t.can_cancel else "-"
        tools.add_row(
            t.name,
            _yes(t.effects),
            cancel,
            _yes(t.has_verifier),
            _yes(t.has_compensator),
            t.stop,
        )
    if result.tools:
        tools.print(c.out)
    else:
        c.out.print("no stopline.Tool objects at module level")
    for name in result.runtime:
        c.out.print(
            f"{name}: an MCP connection: its tools exist only at run time and are not "
            "mapped here (stopline check-mcp profiles the server)"
        )
    gaps = [(t.name, g) for t in result.tools for g in t.gaps]
    if gaps:
        c.out.print("gaps", style="bold yellow")
        for name, gap in gaps:
            c.out.print(f"  {name}: {gap}")


def register(app: typer.Typer) -> None:
    app.command("map")(map_command)
