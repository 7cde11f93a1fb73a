"""The ledger's rules are written once: no twin bodies, no status typed into SQL."""

from __future__ import annotations

import ast
import enum
import re
from collections import defaultdict

from stopline.domain import lifecycle, model, vocab
from tests.architecture.source import modules, sql_strings

# Every word of the contract's vocabularies: a status, a state, an event, a kind.
_VOCABULARY = {
    member.value
    for module in (vocab, lifecycle, model)
    for obj in vars(module).values()
    if isinstance(obj, type) and issubclass(obj, enum.StrEnum) and obj is not enum.StrEnum
    for member in obj
}
_QUOTED = re.compile(r"'([a-z_]+)'")
# The MCP server's effect store is its own table with its own vocabulary (``EffectState``).
_OTHER_STORES = {"stopline.integrations.mcp._store"}
_BACKENDS = ("stopline.ledger.sqlite", "stopline.ledger.postgres")
# The seams a backend fills in: one implementation per backend is the point.
# the seam each backend fills in: its connections and its way of hearing other processes' cancels
_SEAM_METHODS = {
    "one",
    "all",
    "run",
    "many",
    "transaction",
    "_execute",
    "close",
    "open",
    "watch_cancels",
    "record_deferred",  # how a backend queues an outcome: its writer, or its group commit
}


def _normalised(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """A body with its docstring, ``await`` and placeholder spelling taken out."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    text = "\n".join(ast.unparse(statement) for statement in body)
    text = re.sub(r"%\((\w+)\)s", r":\1", text).replace("%s", "?")
    return re.sub(r"\bawait\s+", "", text)


def _functions() -> dict[str, list[tuple[str, str, str]]]:
    """Normalised body -> [(module, function name, first line)], for bodies of 3+ lines."""
    found: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
    for name, (_path, tree) in modules().items():
        if not name.startswith("stopline.ledger"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                body = _normalised(node)
                if body.count("\n") >= 2:
                    found[body].append((name, node.name, str(node.lineno)))
    return found


def test_no_function_body_exists_twice_in_the_ledger() -> None:
    twins = [places for places in _functions().values() if len(places) > 1]
    assert twins == [], f"the same body written twice (fold it into the engine): {twins}"


def test_backends_share_no_function_name_beyond_their_seams() -> None:
    """The 58 twins were functions of one name per backend; the engine holds them now."""
    names: dict[str, set[str]] = {backend: set() for backend in _BACKENDS}
    for name, (_path, tree) in modules().items():
        for backend in _BACKENDS:
            if name == backend or name.startswith(backend + "_"):
                names[backend] |= {
                    node.name
                    for node in ast.walk(tree)
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not node.name.startswith("__")
                }
    shared = names[_BACKENDS[0]] & names[_BACKENDS[1]] - _SEAM_METHODS
    assert shared == set(), f"written once per backend: {sorted(shared)}"


def test_no_status_literal_is_typed_into_sql() -> None:
    """Guards come from the domain's enums (``ledger.engine.guards``), never a quoted word."""
    typed = [
        f"{name}:{line}: '{word}'"
        for name, (_path, tree) in modules().items()
        if name not in _OTHER_STORES
        for line, sql in sql_strings(tree)
        for word in _QUOTED.findall(sql)
        if word in _VOCABULARY
    ]
    assert typed == []


def test_the_literal_check_sees_a_typed_status() -> None:
    """The check above can fail: a guard typed by hand is caught, an f-string field is not."""
    tree = ast.parse(
        "A = \"UPDATE runs SET x = 1 WHERE state = 'running'\"\n"
        'B = f"UPDATE runs SET x = 1 WHERE state IN ({GUARD})"\n'
    )
    caught = [
        w for _line, sql in sql_strings(tree) for w in _QUOTED.findall(sql) if w in _VOCABULARY
    ]
    assert caught == ["running"]
