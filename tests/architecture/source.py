"""The package's source, parsed once for the architecture tests."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

__all__ = ["SRC", "module_name", "modules", "sql_strings"]

SRC = Path(__file__).resolve().parents[2] / "src"
_SQL_WORDS = ("SELECT ", "INSERT ", "UPDATE ", "DELETE ", "WHERE ", "CREATE ")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def modules() -> dict[str, tuple[Path, ast.Module]]:
    """Every module of ``stopline`` by dotted name, with its syntax tree."""
    return {
        module_name(path): (path, ast.parse(path.read_text(), str(path)))
        for path in sorted((SRC / "stopline").rglob("*.py"))
    }


def sql_strings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Each string (an f-string with ``{}`` for its fields) that reads as SQL."""
    inside_fstrings = {
        id(value)
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)
        for value in node.values
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(
                v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "{}"
                for v in node.values
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in inside_fstrings:
                continue
            text = node.value
        else:
            continue
        if any(word in text.upper() for word in _SQL_WORDS):
            yield node.lineno, text
