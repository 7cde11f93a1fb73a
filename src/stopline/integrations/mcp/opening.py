"""What a connection of ``StoplineMCP`` that could not be opened raises (ADR 0117).

Public so that `stopline check-mcp` unwraps the SDK's errors as the client does.

The SDK's failures while opening arrive wrapped in its task groups' ``ExceptionGroup``:
a server that speaks only 2025-11-25 opened with ``mode="2026-07-28"`` (its tool
listing does not parse: ``cacheScope``, ``resultType``, ``ttlMs`` missing), a stdio
command that does not exist (``FileNotFoundError``), one that exits at once (``Connection
closed``), a URL nobody listens at. The first opening raised that group as it came, no
stopline error, naming no server. ``failed_opening`` raises a ``NoAnswer`` instead,
``from`` the SDK's error: cause ``server_error`` for an answer that does not fit the
protocol (with a ``mode=`` other than ``legacy`` or ``auto``: the server does not speak
it, and either of those opens it), else ``transport``. A ``NoAnswer`` raised in the
opening itself (its ``connect_timeout``) is raised as it is.
"""

from __future__ import annotations

from typing import NoReturn

from pydantic import ValidationError

from mcp import StdioServerParameters
from stopline.domain.vocab import Cause
from stopline.errors import NoAnswer, describe

__all__ = ["failed_opening", "first_error"]

_NEGOTIATED = ("legacy", "auto")  # modes that open a 2025-11-25 server


def first_error(exc: BaseException) -> BaseException:
    """The transport's own error, not the task groups' around it (the first one's)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _label(name: str, target: StdioServerParameters | str) -> str:
    where = target if isinstance(target, str) else " ".join([target.command, *target.args])
    return f"MCP server {name!r} ({where})"


def failed_opening(
    name: str, target: StdioServerParameters | str, mode: str, exc: Exception
) -> NoReturn:
    """Raises the typed error for ``exc``, raised while the connection to ``target``
    opened (``from exc``)."""
    error = first_error(exc)
    if isinstance(error, NoAnswer):
        raise error
    raise _typed(_label(name, target), mode, error) from exc


def _typed(server: str, mode: str, error: BaseException) -> NoAnswer:
    if isinstance(error, ValidationError):
        fields = sorted({".".join(map(str, e["loc"])) or "?" for e in error.errors()})
        misfit = f"its {error.title} does not fit ({', '.join(fields)})"
        if mode in _NEGOTIATED:
            return NoAnswer(Cause.SERVER_ERROR, f"{server} could not be opened: {misfit}")
        return NoAnswer(
            Cause.SERVER_ERROR,
            f'{server} does not speak {mode}: {misfit}; mode="legacy" or mode="auto" opens it',
        )
    return NoAnswer(Cause.TRANSPORT, f"{server} could not be opened: {describe(error)}")
