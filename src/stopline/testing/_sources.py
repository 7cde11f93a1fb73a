"""Where a cell's barrier points come from: the runtime, the providers, the workflow."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import FunctionType, MethodType, ModuleType

from stopline.runtime.tool import Tool
from stopline.testing._errors import ExplorerError
from stopline.testing._hooks import Hooks
from stopline.testing.actions import Point
from stopline.testing.barriers import Barriers
from stopline.testing.providers import FakeProvider

__all__ = ["Sources", "find_barriers", "find_providers"]

MAX_DEPTH = 4  # how far into containers and attributes the search looks
# objects the search never looks into: they hold no providers of the user's
_OPAQUE = (FakeProvider, Barriers, Tool, str, bytes, type, ModuleType, FunctionType, MethodType)
_FOREIGN = ("stopline.", "anyio", "trio", "asyncio", "sqlite3", "builtins")


class Sources:
    """Every ``Barriers`` one run passes, by kind and source."""

    def __init__(self, providers: object, hooks: Hooks) -> None:
        self.hooks = hooks
        self.root = providers  # what the factory made, as the workflow receives it
        self.providers = find_providers(providers)
        hooks.responding.update(p.tool.name for p in self.providers.values())
        self.own = find_barriers(providers)

    def all(self) -> list[tuple[str, str, Barriers]]:
        out = [("runtime", "", self.hooks.barriers)]
        out.extend(("provider", name, p.barriers) for name, p in self.providers.items())
        out.extend(("workflow", name, b) for name, b in self.own.items())
        return out

    def barriers_for(self, point: Point) -> Barriers | None:
        if point.kind == "runtime":
            return self.hooks.barriers
        if point.kind == "provider":
            provider = self.providers.get(point.source)
            return provider.barriers if provider is not None else None
        return self.own.get(point.source)


def find_providers(obj: object) -> dict[str, FakeProvider]:
    """Every ``FakeProvider`` in ``obj``, by provider name: ``obj`` itself, or found
    in its mappings, sequences, sets and attributes (``__dict__`` and ``__slots__``),
    down to ``MAX_DEPTH`` levels, each object once. Two providers of one name are
    refused (``ExplorerError``): their tools share the name, and the ledger's records
    could not say which one a call went to."""
    found: dict[str, FakeProvider] = {}
    where: dict[str, str] = {}
    for path, item in _walk(obj):
        if not isinstance(item, FakeProvider):
            continue
        if item.name in found:
            raise ExplorerError(
                f"two FakeProviders are named {item.name!r} (at {where[item.name] or 'the top'}"
                f" and {path or 'the top'}): give each provider a name of its own"
            )
        found[item.name], where[item.name] = item, path
    return found


def find_barriers(obj: object) -> dict[str, Barriers]:
    """A workflow's own ``Barriers`` in ``obj`` (not its providers'), by the path they
    were found at (``"points"``, ``"env.points"``; ``"barriers"`` for ``obj`` itself)."""
    if isinstance(obj, Barriers):
        return {"barriers": obj}
    return {path: item for path, item in _walk(obj) if isinstance(item, Barriers) and path}


def _walk(obj: object) -> Iterator[tuple[str, object]]:
    """(path, value) for ``obj`` and everything reachable from it, each object once."""
    seen: set[int] = set()
    todo: list[tuple[str, object, int]] = [("", obj, 0)]
    while todo:
        path, value, depth = todo.pop(0)
        if id(value) in seen:
            continue
        seen.add(id(value))
        yield path, value
        if depth < MAX_DEPTH:
            todo.extend((_join(path, name), v, depth + 1) for name, v in _children(value))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _children(value: object) -> list[tuple[str, object]]:
    if isinstance(value, _OPAQUE) or value is None:
        return []
    if isinstance(value, Mapping):
        return [(str(k), v) for k, v in value.items()]
    if isinstance(value, list | tuple):
        return [(str(n), v) for n, v in enumerate(value)]
    if isinstance(value, set | frozenset):
        return [(str(n), v) for n, v in enumerate(value)]
    if type(value).__module__.startswith(_FOREIGN):
        return []
    out: list[tuple[str, object]] = list(getattr(value, "__dict__", {}).items())
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                out.append((name, getattr(value, name)))
    return out
