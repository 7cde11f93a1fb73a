"""Bytes a stdio server writes that are not UTF-8 end its connection at once.

MCP messages are UTF-8. The SDK's stdio reader decodes strictly: a byte that
is not UTF-8 raises in its reader task, which then drains the pipe until the
server process ends before the error reaches anyone, while every call in
flight waits out its deadline (300 s by default) and the server's real answer
is lost. ``watched`` gives the reader an error handler that is strict as well
but first tells the connection (``on_bad_bytes``): the connection is broken
there and then, and its calls in flight end as ``unknown``, cause transport
(R3). A handler the user chose (``ignore``, ``replace``) is left alone.
"""

from __future__ import annotations

import codecs
import contextvars
from collections.abc import Callable

from mcp import StdioServerParameters
from stopline.errors import describe

__all__ = ["on_bad_bytes", "watched"]

_HANDLER = "stopline.mcp-strict"
_TELL: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar(
    "stopline_mcp_bad_bytes", default=None
)


def _strict_and_tell(exc: UnicodeError) -> tuple[str, int]:
    """``strict``, after telling the connection whose reader met the bytes (the reader
    task was started in the context ``on_bad_bytes`` set)."""
    tell = _TELL.get()
    if tell is not None:
        tell(f"the server wrote bytes that are not UTF-8: {describe(exc)}")
    raise exc


codecs.register_error(_HANDLER, _strict_and_tell)


def watched(params: StdioServerParameters) -> StdioServerParameters:
    """``params`` whose reader tells the connection of bytes that are not UTF-8."""
    if params.encoding_error_handler != "strict":
        return params  # the user's own choice: bytes are ignored or replaced, nothing ends
    return params.model_copy(update={"encoding_error_handler": _HANDLER})


def on_bad_bytes(tell: Callable[[str], None]) -> None:
    """Where a stdio transport opened after this, in this context, reports bad bytes."""
    _TELL.set(tell)
