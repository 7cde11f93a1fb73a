"""What an HTTP status proves that the SDK's JSON-RPC error loses.

Over Streamable HTTP the SDK turns a refused POST into a JSON-RPC error (for a
404 the server's ``-32600 Session not found``, for a 413 a stand-in ``-32603``)
and drops the status. Two statuses prove the server never processed the
request:

- **404** to a request that carried an ``Mcp-Session-Id``: the server has no
  such session (it restarted, or dropped an idle one: the SDK server's
  default idle timeout is 30 minutes). The specification says the client
  must start a new session; the request was not processed. A 404 to a
  request without a session proves nothing (a gateway's "not found").
- **413**: the body is over the server's limit, refused before it was read as
  a request.

``HttpRefusals`` is a response hook on the connection's own HTTP client: it
keeps these statuses by the ``tools/call``'s JSON-RPC id, for the call to
ask about its own request, and says at once when the session is gone.
"""

from __future__ import annotations

import collections
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import httpx2
from mcp.client._transport import TransportStreams
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

__all__ = ["NOT_PROCESSED", "HttpRefusals", "http_transport"]

NOT_PROCESSED = {
    404: "the server has no such session (HTTP 404; it restarted or dropped an idle one)",
    413: "the request is over the server's size limit (HTTP 413)",
}
"""The HTTP statuses that prove a request was never processed, and what each says."""


class HttpRefusals:
    """The ``tools/call`` POSTs one connection's server refused unprocessed, by id."""

    def __init__(self, remember: int = 1024) -> None:
        self.on_session_gone: Callable[[], None] = lambda: None  # set once the client is made
        self._remember = remember
        self._by_id: collections.OrderedDict[str, int] = collections.OrderedDict()

    async def __call__(self, response: httpx2.Response) -> None:
        request = response.request
        status = response.status_code
        if request.method != "POST" or status not in NOT_PROCESSED:
            return
        if status == 404:
            if "mcp-session-id" not in request.headers:
                return  # no session to lose: proves nothing
            self.on_session_gone()  # the next use opens a new session
        try:
            body: Any = json.loads(request.content)
        except (ValueError, httpx2.RequestNotRead):
            return
        if isinstance(body, dict) and body.get("method") == "tools/call" and "id" in body:
            self._by_id[str(body["id"])] = status
            while len(self._by_id) > self._remember:
                self._by_id.popitem(last=False)

    def status_of(self, request_ids: Iterable[Any]) -> int | None:
        """The refusal of one of ``request_ids`` (this connection's), if the server sent one."""
        for request_id in request_ids:
            if (status := self._by_id.get(str(request_id))) is not None:
                return status
        return None


@contextlib.asynccontextmanager
async def http_transport(url: str, refusals: HttpRefusals) -> AsyncIterator[TransportStreams]:
    """The SDK's Streamable HTTP transport on an HTTP client (the SDK's defaults) that
    shows ``refusals`` every response."""
    async with create_mcp_http_client() as http:
        http.event_hooks = {"response": [refusals]}
        async with streamable_http_client(url, http_client=http) as streams:
            yield streams
