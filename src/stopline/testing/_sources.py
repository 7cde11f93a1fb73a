"""Where a cell's barrier points come from: the runtime, the providers, the workflow."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from stopline.testing._hooks import Hooks
from stopline.testing.actions import Point
from stopline.testing.barriers import Barriers
from stopline.testing.providers import FakeProvider

__all__ = ["Sources", "find_barriers", "find_providers"]


class Sources:
    """Every ``Barriers`` one run passes, by kind and source."""

    def __init__(self, providers: object, hooks: Hooks) -> None:
        self.hooks = hooks
        self.providers = find_providers(providers)
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
    """The ``FakeProvider``s in ``obj``: itself, a mapping's values, a sequence's items,
    or an object's attributes (one level down), by provider name."""
    found: dict[str, FakeProvider] = {}
    for item in _members(obj):
        if isinstance(item, FakeProvider):
            found.setdefault(item.name, item)
    return found


def find_barriers(obj: object) -> dict[str, Barriers]:
    """A workflow's own ``Barriers`` in ``obj`` (not its providers'), by where they were found."""
    found: dict[str, Barriers] = {}
    if isinstance(obj, FakeProvider):
        return found
    if isinstance(obj, Barriers):
        return {"barriers": obj}
    if isinstance(obj, Mapping):
        items: Iterable[tuple[str, Any]] = ((str(k), v) for k, v in obj.items())
    elif isinstance(obj, list | tuple):
        items = ((str(n), v) for n, v in enumerate(obj))
    else:
        items = vars(obj).items() if hasattr(obj, "__dict__") else ()
    for name, value in items:
        if isinstance(value, Barriers):
            found[name] = value
    return found


def _members(obj: object) -> list[Any]:
    if isinstance(obj, FakeProvider):
        return [obj]
    if isinstance(obj, Mapping):
        return list(obj.values())
    if isinstance(obj, list | tuple):
        return list(obj)
    return list(vars(obj).values()) if hasattr(obj, "__dict__") else []
