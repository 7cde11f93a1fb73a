"""The layers of STYLE.md, checked: domain <- ledger <- runtime <- integrations <- surfaces.

A module imports only from its own layer or below, and never a private name
(``_x``) of a package other than its own.
"""

from __future__ import annotations

import ast

from tests.architecture.source import modules

# errors sit beside the domain: both are pure, and the domain raises them
LAYERS: dict[str, int] = {
    "errors": 0,
    "domain": 0,
    "ledger": 1,
    "runtime": 2,
    "integrations": 3,
    "telemetry": 3,
    "testing": 3,
    "cli": 4,
    "console": 4,
    "bench": 4,
    "demo": 4,
    "": 4,  # the package itself: the facade re-exports every layer
}
# ``__version__`` is metadata, read by any layer that reports it
_METADATA = {"__version__"}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else ""]


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(imported module, names imported from it) for every ``stopline`` import."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "stopline":
                found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "stopline"]
    return found


def _package(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def test_every_module_has_a_layer() -> None:
    assert {name.split(".")[1] for name in modules() if "." in name} <= set(LAYERS)


def test_no_import_reaches_up_a_layer() -> None:
    upward = [
        f"{name} ({_layer(name)}) -> {target} ({_layer(target)})"
        for name, (_path, tree) in modules().items()
        for target, names in _imports(tree)
        if _layer(target) > _layer(name) and not set(names) <= _METADATA
    ]
    assert upward == []


def test_no_private_name_is_imported_across_packages() -> None:
    crossing = []
    for name, (path, tree) in modules().items():
        home = _package(name, path.name == "__init__.py")
        for target, names in _imports(tree):
            parts = target.split(".")
            private_module = any(p.startswith("_") and not p.startswith("__") for p in parts)
            if private_module and not name.startswith(_private_owner(parts)):
                crossing.append(f"{name} imports module {target}")
            for imported in names:
                private = imported.startswith("_") and imported not in _METADATA
                if private and not (home + ".").startswith(target + "."):
                    crossing.append(f"{name} imports {target}.{imported}")
    assert crossing == []


def _private_owner(parts: list[str]) -> str:
    """The package a private module belongs to: the path up to its first private part."""
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return ".".join(parts)


def test_the_layer_check_sees_an_upward_import() -> None:
    tree = ast.parse("from stopline.runtime.ledger import Ledger\nimport stopline.cli\n")
    targets = [target for target, _names in _imports(tree)]
    assert [t for t in targets if _layer(t) > _layer("stopline.domain.model")] == targets


def test_every_exception_of_the_library_is_defined_in_stopline_errors() -> None:
    """One errors module with the whole tree (the exit-code errors of the CLI and the
    console, and the testing kit's own failures, belong to those surfaces)."""
    surfaces = ("stopline.cli", "stopline.console", "stopline.testing", "stopline.bench")
    elsewhere = [
        f"{name}.{node.name}"
        for name, (_path, tree) in modules().items()
        if name != "stopline.errors" and not name.startswith(surfaces)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and not node.name.startswith("_")  # a module's own control flow, never raised out
        and any(
            (isinstance(base, ast.Name) and base.id.endswith(("Error", "Exception")))
            or (isinstance(base, ast.Name) and base.id in {"StoplineError", "BaseException"})
            for base in node.bases
        )
    ]
    assert elsewhere == []


def test_no_module_is_over_500_lines() -> None:
    """STYLE.md: aim for 150-400 lines, split before 500."""
    long = {
        name: lines
        for name, (path, _tree) in modules().items()
        if (lines := len(path.read_text().splitlines())) > 500
    }
    assert long == {}
