"""The transport one connection of ``StoplineMCP`` opens, and the end of a stdio server's
output told at once.

A stdio server whose output ends (it exited, crashed, or closed its stdout) while no
call is in flight left the connection looking open: the SDK's dispatcher knows it
closed, the client wrapper did not, and the next call was handed to the dead
connection, refused there, and recorded ``unknown`` (transport), a call no server
ever read, sent to review. ``EndOfOutput`` watches the inbound stream: its end drops
the connection (``on_end``), so the next call opens a new one. Calls in flight on
it end as the SDK ends them (``CONNECTION_CLOSED``: ``unknown``, cause transport).
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import anyio
from mcp.client._transport import Transport, TransportStreams
from mcp.client.stdio import stdio_client

from mcp import StdioServerParameters
from stopline.integrations.mcp._http import HttpRefusals, http_transport
from stopline.integrations.mcp._stdio import watched

__all__ = ["EndOfOutput", "transport_for"]

_ENDED = (anyio.EndOfStream, anyio.ClosedResourceError, StopAsyncIteration)


class EndOfOutput:
    """A transport whose inbound stream's end calls ``on_end`` before the SDK sees it."""

    def __init__(self, inner: Transport) -> None:
        self._inner = inner
        self.on_end: Callable[[], None] = lambda: None

    async def __aenter__(self) -> TransportStreams:
        read, write = await self._inner.__aenter__()
        return _Watched(read, self), write

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return await self._inner.__aexit__(et, exc, tb)


class _Watched:
    def __init__(self, inner: Any, ends: EndOfOutput) -> None:
        self._inner, self._ends = inner, ends

    @property
    def last_context(self) -> Any:  # duck-typed by the SDK's dispatcher
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except _ENDED:
            self._ends.on_end()
            raise

    def __aiter__(self) -> _Watched:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._inner.__anext__()
        except _ENDED:
            self._ends.on_end()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _Watched:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._inner.aclose()


def transport_for(target: StdioServerParameters | str, refusals: HttpRefusals) -> Any:
    """A new transport to ``target``: Streamable HTTP with ``refusals`` seeing each
    response, or stdio with bad bytes told (``watched``) and the end of the server's
    output dropping the connection as a lost HTTP session does (``on_session_gone``,
    read when it happens: it is set once the client is made)."""
    if not isinstance(target, StdioServerParameters):
        return http_transport(target, refusals)
    watch = EndOfOutput(stdio_client(watched(target)))
    watch.on_end = lambda: refusals.on_session_gone()
    return watch
