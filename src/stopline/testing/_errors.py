"""The explorer's own error: the exploration as a whole cannot go on."""

from __future__ import annotations

from stopline.errors import StoplineError

__all__ = ["ExplorerError"]


class ExplorerError(StoplineError):
    """The exploration cannot start or go on: the workflow fails on its own, the
    providers factory fails, two providers share a name, a bad ``only`` or action."""
