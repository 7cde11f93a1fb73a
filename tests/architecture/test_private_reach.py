"""No reach into another module's private attributes (STYLE.md principle 15).

``x._name`` on anything but ``self`` or ``cls`` is a reach when ``_name`` is
not defined in the module that uses it: a component reading another's
internals instead of a public name or a method. Third-party internals that
stopline cannot avoid are allowed by name, each with its reason.
"""

from __future__ import annotations

import ast

from tests.architecture.source import modules

# (module, "receiver._name") -> why it is allowed
ALLOWED: dict[tuple[str, str], str] = {
    ("stopline.ledger", "parts._replace"): "namedtuple's documented API (urllib's SplitResult)",
    ("stopline.integrations.mcp.testing", "os._exit"): "the stdlib's documented hard exit",
    ("stopline.integrations._dbos_watch", "_get_dbos_instance()._sys_db"): (
        "DBOS publishes no read of its system database that does not wait out an outage: "
        "the watcher of waiting workflows reads once an interval (ADR 0106), and a "
        "workflow's ownership token tells its code's cancel error from DBOS's (ADR 0114)"
    ),
    ("stopline.integrations.mcp.testing", "_stdio._claims"): (
        "the MCP SDK's stdio server keeps the real wire as a private dup of fd 1"
    ),
    ("stopline.integrations.mcp.testing", "server._lowlevel_server"): (
        "FastMCP exposes its low-level server only under this name"
    ),
    ("stopline.integrations.mcp.tasks_client", "session._stamp"): (
        "the MCP SDK's per-request stamp, the level below send_request (tasks/* requests)"
    ),
    ("stopline.integrations.mcp.tasks_client", "session._dispatcher"): (
        "the MCP SDK's dispatcher, the level below send_request (tasks/* requests)"
    ),
    ("stopline.integrations._langchain_tools", "BaseTool._arun"): (
        "LangChain's documented extension point: a BaseTool subclass implements _run/_arun"
    ),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assigned attributes and
    names, imports (``import x as _x``), and ``__slots__`` entries."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries, and names given to setattr
    return {n for n in names if _private(n)}


def reaches(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, "receiver._name")`` for every reach into a private name defined elsewhere."""
    mine = defined(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if node.attr not in mine:
            found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
    return sorted(found)


def test_no_module_reaches_into_another_modules_private_attributes() -> None:
    found = [
        f"{name}:{line} {what}"
        for name, (_path, tree) in modules().items()
        for line, what in reaches(tree)
        if (name, what) not in ALLOWED
    ]
    assert found == []


def test_every_allowed_reach_is_still_there() -> None:
    """An entry nobody needs any more is removed, not kept as a licence."""
    present = {
        (name, what) for name, (_path, tree) in modules().items() for _line, what in reaches(tree)
    }
    assert set(ALLOWED) - present == set()


def test_a_planted_reach_is_found() -> None:
    planted = ast.parse(
        "class Settler:\n"
        "    def __init__(self, ledger):\n"
        "        self._ledger = ledger\n"
        "    def advance(self, run_id):\n"
        "        run = self._ledger._local[run_id]\n"  # _local: another module's
        "        self._ledger.changed(run_id)\n"  # public: fine
        "        return run._inflight, self._seen, other.__class__\n"  # _inflight reaches
    )
    assert reaches(planted) == [(5, "self._ledger._local"), (7, "run._inflight")]


def test_a_private_name_of_the_same_module_is_not_a_reach() -> None:
    tree = ast.parse(
        "class Box:\n"
        "    def __init__(self):\n"
        "        self._items = []\n"
        "def merge(a, b):\n"
        "    return a._items + b._items\n"
    )
    assert reaches(tree) == []
