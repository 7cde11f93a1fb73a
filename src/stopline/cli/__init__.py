"""The ``stopline`` command line: see and act on runs without reading SQL.

Exit codes (docs/cli.md): 0 settled, 1 error, 2 usage (or a missing extra),
3 still verifying or awaiting confirmation, 4 needs review, 5 nothing to do.

Importing this package imports none of the commands: ``main`` takes Ctrl-C first and
imports them after, so that a Ctrl-C while they import ends the command with its exit
code and one line, not a traceback (ADR 0115). ``app`` and the exit codes load on
first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from stopline.cli._loop import starting

if TYPE_CHECKING:
    from stopline.cli._app import app
    from stopline.cli._common import (
        EXIT_ERROR,
        EXIT_NEEDS_REVIEW,
        EXIT_NOTHING_TO_DO,
        EXIT_OK,
        EXIT_PENDING,
        EXIT_USAGE,
    )

__all__ = [
    "EXIT_ERROR",
    "EXIT_NEEDS_REVIEW",
    "EXIT_NOTHING_TO_DO",
    "EXIT_OK",
    "EXIT_PENDING",
    "EXIT_USAGE",
    "app",
    "main",
]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``stopline``, ``python -m stopline.cli``): errors are one line on
    stderr, never a traceback; returns the exit code. A Ctrl-C while the commands
    import ends it before it starts (``_app.interrupted_at_start``)."""
    with starting() as start:
        from stopline.cli import _app
    if start.presses:
        return _app.interrupted_at_start(argv)
    return _app.main(argv)


def __getattr__(name: str) -> object:
    if name in __all__:
        from stopline.cli import _app, _common

        return _app.app if name == "app" else getattr(_common, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
