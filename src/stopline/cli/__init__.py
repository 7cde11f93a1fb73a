"""The ``stopline`` command line: see and act on runs without reading SQL.

Exit codes (docs/cli.md): 0 settled, 1 error, 2 usage (or a missing extra),
3 still verifying or awaiting confirmation, 4 needs review, 5 nothing to do.
"""

from stopline.cli._app import app, main
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
