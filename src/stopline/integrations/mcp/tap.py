"""A transport tap that keeps the answers the SDK would throw away (R4).

The SDK forgets a request the moment its caller stops waiting (a cancel, a
timeout) and drops a later answer at debug level. ``LateResponseTap`` wraps
any client ``Transport`` and sits between it and the SDK's dispatcher:

- an outbound ``tools/call`` is remembered with the stopline key from its
  ``_meta["io.stopline/key"]`` (request id -> operation id);
- an outbound ``notifications/cancelled`` marks that id abandoned (on 2026
  Streamable HTTP the transport turns it into a stream close; the tap still
  sees it first), and ``on_cancel(key, request id)`` says a keyed request was
  told to stop: what a cut of its caller sent, as the wire saw it (R14);
- the next inbound response or error for an abandoned id is handed to
  ``on_late(LateAnswer)`` instead of vanishing. An answer that reached the
  dispatcher just before the cancel (the caller was cancelled before it
  consumed it) is reported too, marked ``raced``;
- every inbound notification's method is handed to ``on_notice`` in receive
  order (the SDK hands notifications to tasks, which may run after a later
  response): the client learns of ``notifications/tools/list_changed`` before
  the answer that followed it.

``on_late`` and ``on_notice`` run on the transport's read path: they must not
block (the client wrapper hands the work to a task).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from types import TracebackType
from typing import Any

from mcp.client._transport import Transport, TransportStreams
from mcp.shared.dispatcher import as_request_id, coerce_request_id
from mcp.shared.message import SessionMessage
from mcp_types import ErrorData, JSONRPCError, JSONRPCNotification, JSONRPCRequest, JSONRPCResponse

from stopline.integrations.mcp._vocab import KEY_META, OUTCOME_DATA
from stopline.runtime.tool import Verdict

__all__ = ["LateAnswer", "LateResponseTap", "classify_late"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class LateAnswer:
    """An answer nobody was waiting for any more."""

    request_id: Any
    key: str | None  # the stopline operation id, when the request carried one
    result: dict[str, Any] | None  # the JSON-RPC result, or
    error: ErrorData | None  # the JSON-RPC error
    reason: str  # why the client stopped waiting ("caller cancelled", "timed out after 5s")
    raced: bool = False  # the answer beat the cancel frame to the dispatcher


@dataclasses.dataclass(slots=True)
class _Sent:
    method: str
    key: str | None
    sent_at: float
    reason: str = ""


class LateResponseTap:
    """Wrap ``inner`` (a ``Transport``); call ``on_late`` for every late answer."""

    def __init__(
        self,
        inner: Transport,
        on_late: Callable[[LateAnswer], None],
        *,
        remember: int = 1024,
        on_request: Callable[[str, Any], None] | None = None,
        on_cancel: Callable[[str, Any], None] | None = None,
        on_notice: Callable[[str], None] | None = None,
    ) -> None:
        self._inner = inner
        self._on_late = on_late
        self._on_request = on_request  # (key, request id) as a keyed tools/call is written
        self._on_cancel = on_cancel  # (key, request id) as its cancel is written
        self._on_notice = on_notice  # (method) of each notification as it is read
        self._remember = remember
        self.in_flight: dict[Any, _Sent] = {}
        self.abandoned: dict[Any, _Sent] = {}  # cancelled by us, no answer seen (yet)
        self._recent: OrderedDict[Any, tuple[_Sent, dict[str, Any] | ErrorData]] = OrderedDict()

    async def __aenter__(self) -> TransportStreams:
        read, write = await self._inner.__aenter__()
        return _Read(read, self._inbound), _Write(write, self._outbound)

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return await self._inner.__aexit__(et, exc, tb)

    def _outbound(self, sm: SessionMessage) -> None:
        m = sm.message
        if isinstance(m, JSONRPCRequest):
            params = m.params or {}
            meta = params.get("_meta") or {}
            key = meta.get(KEY_META) if isinstance(meta, dict) else None
            sent = _Sent(m.method, key if isinstance(key, str) else None, time.time())
            self.in_flight[coerce_request_id(m.id)] = sent
            if sent.key is not None and self._on_request is not None:
                self._on_request(sent.key, m.id)
        elif isinstance(m, JSONRPCNotification) and m.method == "notifications/cancelled":
            params = m.params or {}
            rid = as_request_id(params.get("requestId"))
            if rid is None:
                return
            pending = coerce_request_id(rid)
            reason = str(params.get("reason") or "")
            if (info := self.in_flight.pop(pending, None)) is not None:
                info.reason = reason
                self.abandoned[pending] = info
            elif (seen := self._recent.pop(pending, None)) is not None:
                info, outcome = seen
                info.reason = reason
                self._fire(rid, info, outcome, raced=True)
            else:
                return  # no request of ours in flight: nothing was told to stop
            if info.key is not None and self._on_cancel is not None:
                self._on_cancel(info.key, rid)

    def _inbound(self, item: SessionMessage | Exception) -> None:
        if not isinstance(item, SessionMessage):
            return  # a transport-level error item (e.g. an unparseable line): the SDK reports it
        m = item.message
        if isinstance(m, JSONRPCNotification) and self._on_notice is not None:
            try:
                self._on_notice(m.method)
            except Exception:  # never break the read path
                logger.exception("stopline: handling an MCP notification failed")
        if not isinstance(m, JSONRPCResponse | JSONRPCError) or m.id is None:
            return
        outcome: dict[str, Any] | ErrorData = (
            m.result if isinstance(m, JSONRPCResponse) else m.error
        )
        pending = coerce_request_id(m.id)
        if (info := self.abandoned.pop(pending, None)) is not None:
            self._fire(m.id, info, outcome, raced=False)
            return
        sent = self.in_flight.pop(pending, None)
        if sent is not None and sent.key is not None:
            self._recent[pending] = (sent, outcome)
            while len(self._recent) > self._remember:
                self._recent.popitem(last=False)

    def _fire(
        self, rid: Any, info: _Sent, outcome: dict[str, Any] | ErrorData, *, raced: bool
    ) -> None:
        result = outcome if isinstance(outcome, dict) else None
        error = outcome if isinstance(outcome, ErrorData) else None
        try:
            self._on_late(LateAnswer(rid, info.key, result, error, info.reason, raced))
        except Exception:  # never break the read path
            logger.exception("stopline: handling a late MCP answer failed")


class _Read:
    def __init__(self, inner: Any, hook: Callable[[Any], None]) -> None:
        self._inner, self._hook = inner, hook

    @property
    def last_context(self) -> Any:  # duck-typed by the SDK's dispatcher
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> Any:
        item = await self._inner.receive()
        self._hook(item)
        return item

    def __aiter__(self) -> _Read:
        return self

    async def __anext__(self) -> Any:
        item = await self._inner.__anext__()
        self._hook(item)
        return item

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _Read:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._inner.aclose()


class _Write:
    def __init__(self, inner: Any, hook: Callable[[SessionMessage], None]) -> None:
        self._inner, self._hook = inner, hook

    async def send(self, item: SessionMessage, /) -> None:
        self._hook(item)
        await self._inner.send(item)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _Write:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._inner.aclose()


def classify_late(late: LateAnswer) -> tuple[Verdict, Any, str]:
    """What a late answer proves: a success commits; a refusal by stopline's rule does not."""
    why = f"late answer after {late.reason or 'abandon'}" + (" (raced)" if late.raced else "")
    if late.result is not None:
        if late.result.get("isError"):
            return Verdict.UNKNOWN, late.result, f"{why}: tool error"
        structured = late.result.get("structuredContent")
        if structured is not None:
            return Verdict.COMMITTED, structured, why
        content = late.result.get("content")
        blocks = content if isinstance(content, list) else []  # a server we never saw
        texts = [c.get("text") for c in blocks if isinstance(c, dict) and c.get("type") == "text"]
        return Verdict.COMMITTED, "\n".join(t for t in texts if isinstance(t, str)), why
    error: ErrorData | None = late.error
    assert error is not None
    data = error.data if isinstance(error.data, dict) else {}
    if data.get(OUTCOME_DATA) == "not_committed":
        return Verdict.NOT_COMMITTED, None, f"{why}: {error.message}"
    return Verdict.UNKNOWN, None, f"{why}: error {error.code} {error.message!r} proves nothing"
