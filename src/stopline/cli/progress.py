"""Progress bars for long work (``bench``, ``reconcile``, ``check-mcp``), drawn with rich.

    from stopline.cli.progress import progress

    with progress("reconciling", total=len(ops)) as bar:
        for op in ops:
            ...
            bar.advance()

The bar goes to stderr, so stdout stays clean for ``--json`` and pipes, and
only to an interactive terminal: elsewhere (CI logs, a pipe) it draws
nothing. It is transient: when the work ends the bar is erased and the
command prints its result. ``update(done, total)`` suits callbacks that
report counts, such as ``Ledger.reconcile(on_progress=...)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from stopline.cli._common import printable

__all__ = ["Bar", "progress"]


class Bar:
    """One task's bar; every method is a no-op when nothing is drawn."""

    def __init__(self, drawn: Progress | None = None, task: TaskID | None = None) -> None:
        self._drawn = drawn
        self._task = task

    @property
    def drawn(self) -> bool:
        return self._drawn is not None

    def advance(self, steps: int = 1) -> None:
        if self._drawn is not None and self._task is not None:
            self._drawn.advance(self._task, steps)

    def update(self, done: int, total: int | None = None) -> None:
        """``done`` of ``total`` (a total of None keeps the one known)."""
        if self._drawn is not None and self._task is not None:
            if total is not None:
                self._drawn.update(self._task, total=total)
            self._drawn.update(self._task, completed=done)

    def describe(self, text: str) -> None:
        if self._drawn is not None and self._task is not None:
            self._drawn.update(self._task, description=printable(text))


@contextlib.contextmanager
def progress(
    description: str, total: int | None = None, *, console: Console | None = None
) -> Iterator[Bar]:
    """A bar for ``total`` steps (None: a spinner until a total is known)."""
    if console is None:
        from stopline.cli._common import err

        console = err
    if not console.is_interactive:
        yield Bar()
        return
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),  # a tool's name is not markup
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as drawn:
        yield Bar(drawn, drawn.add_task(printable(description), total=total))
