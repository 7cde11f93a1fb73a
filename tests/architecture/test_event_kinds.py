"""Event kinds go through the enums of ``stopline.domain.vocab``, never bare strings.

The log's kinds are ``RunEvent``, ``OpEvent``, ``LogKind`` and ``NoteKind``.
A bare string where one of them is meant drifts silently when a member is
renamed (STYLE.md principle 3). Flagged:

- a string literal compared with a ``kind`` (``e.kind == "cancel"``,
  ``kind in {"settled", "escalate"}``) that is one of those kinds;
- a string literal as the kind of ``Backend.note`` (``note(op, "progress", ...)``);
- a table (dict keys, set, list or tuple) holding two or more literals that are
  kinds, all of them kinds (``{"settled": ..., "escalate": ...}``).
"""

from __future__ import annotations

import ast

from stopline.domain.vocab import LogKind, NoteKind, OpEvent, RunEvent
from tests.architecture.source import modules

KINDS = frozenset(str(m) for e in (RunEvent, OpEvent, LogKind, NoteKind) for m in e)


def _literals(node: ast.AST) -> list[str]:
    """The string literals ``node`` is, or holds (a set, list, tuple, frozenset(...))."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("frozenset", "set", "tuple", "list")
        and node.args
    ):
        return _literals(node.args[0])
    if isinstance(node, ast.Set | ast.List | ast.Tuple):
        return [v for e in node.elts for v in _literals(e)]
    return []


def _is_kind(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "kind") or (
        isinstance(node, ast.Name) and node.id == "kind"
    )


def bare_kinds(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, literal)`` for each bare string used as an event kind."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_kind(s) for s in sides):
                found += [
                    (node.lineno, v)
                    for s in sides
                    if not _is_kind(s)
                    for v in _literals(s)
                    if v in KINDS
                ]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "note"
        ):
            kind = node.args[1] if len(node.args) > 1 else None
            kind = next((k.value for k in node.keywords if k.arg == "kind"), kind)
            if isinstance(kind, ast.Constant) and isinstance(kind.value, str):
                found.append((node.lineno, kind.value))
        if isinstance(node, ast.Dict | ast.Set | ast.List | ast.Tuple):
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            strings = [v for e in elts if e is not None for v in _literals(e)]
            if len(strings) >= 2 and all(v in KINDS for v in strings):
                found += [(node.lineno, v) for v in strings]
    return sorted(set(found))


def test_no_bare_string_is_used_as_an_event_kind() -> None:
    found = [
        f"{name}:{line} {literal!r}"
        for name, (_path, tree) in modules().items()
        if name != "stopline.domain.vocab"
        for line, literal in bare_kinds(tree)
    ]
    assert found == []


def test_planted_bare_kinds_are_found() -> None:
    planted = ast.parse(
        "started = [e for e in events if e.kind == 'cancel']\n"
        "ended = [e for e in events if e.kind in {'settled', 'escalate'}]\n"
        "await backend.note(op_id, 'progress', {})\n"
        "WORDS = {'gate_passed': 'passed the gate', 'lost': 'no answer'}\n"
        "fine = [e for e in events if e.kind == RunEvent.CANCEL or e.kind == 'runtime']\n"
        "await backend.note(op_id, NoteKind.PROGRESS, {'phase': 1, 'x': 2})\n"
    )
    assert bare_kinds(planted) == [
        (1, "cancel"),
        (2, "escalate"),
        (2, "settled"),
        (3, "progress"),
        (4, "gate_passed"),
        (4, "lost"),
    ]
