"""A server's tool listing as the client reads it: one declaration per name.

A listing may name one tool more than once (a proxy that merges servers, a
server's bug). Which copy the server runs when the name is called cannot be
known, so no copy may weaken the gate: the client keeps one entry per name,
the first copy carrying the most conservative declaration of them all.

- ``io.stopline/effects`` is ``false`` (a read, sent without the gate) only
  when every copy says ``false``; when every copy declares it, it is
  ``true`` otherwise; when a copy declares nothing, it is dropped, which
  leaves the safe default (effectful) and no claim that the server reads the
  idempotency key (a re-issue relies on that claim);
- ``io.stopline/cancellable`` is the least cancellable copy's (``never``,
  then ``until_accepted``, the default, then ``after_accepted``);
- ``readOnlyHint`` is ``true`` only when every copy says so;
- ``io.stopline/tracked`` (the server records every call by key, ADR 0063) stands
  only when every copy declares it.

A listing that changes during the session (``notifications/tools/list_changed``,
a new connection) is read the same way over time: each name keeps the most
conservative declaration any listing of the session gave it (``Listing``, ADR
0062). A client-side ``ToolPolicy`` still overrides the result. A server's ``Effects``
reads its own tools through a ``Listing`` too (``_tracking``, ADR 0067): a tool that
served calls untracked is not believed tracked later in that process.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import anyio
from mcp.client.subscriptions import SubscriptionLost
from mcp_types import Tool as McpTool
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from mcp import Client
from stopline.domain.vocab import Cancellable, Cause
from stopline.errors import NoAnswer
from stopline.integrations.mcp._vocab import CANCELLABLE_META, EFFECTS_META, TRACKED_META
from stopline.runtime.boundary import Backoff

__all__ = ["CHANGED", "Listing", "conservative", "follow", "index_tools", "list_all"]

logger = logging.getLogger(__name__)

# least cancellable first: a conflict takes the first of these any copy declares
_LEAST_CANCELLABLE = (Cancellable.NEVER, Cancellable.UNTIL_ACCEPTED, Cancellable.AFTER_ACCEPTED)


def index_tools(tools: Iterable[McpTool]) -> dict[str, McpTool]:
    """The listing by name; a name listed more than once gets ``conservative`` copies."""
    copies: dict[str, list[McpTool]] = {}
    for tool in tools:
        copies.setdefault(tool.name, []).append(tool)
    out: dict[str, McpTool] = {}
    for name, same in copies.items():
        out[name] = same[0] if len(same) == 1 else conservative(same)
        if len({t.model_dump_json() for t in same}) > 1:
            logger.warning(
                "stopline: the MCP server lists tool %r %d times with different declarations;"
                " the most conservative is used",
                name,
                len(same),
            )
    return out


def _cancellable(raw: object) -> Cancellable:
    if isinstance(raw, str) and raw in Cancellable.__members__.values():
        return Cancellable(raw)
    return Cancellable.UNTIL_ACCEPTED  # what no declaration means


def conservative(copies: Sequence[McpTool]) -> McpTool:
    """The first copy, declaring what the most conservative copy declares."""
    first = copies[0]
    metas = [c.meta or {} for c in copies]
    meta = dict(first.meta or {})
    effects = [m.get(EFFECTS_META) for m in metas]
    if all(isinstance(v, bool) for v in effects):
        meta[EFFECTS_META] = not all(v is False for v in effects)
    else:  # a copy declares nothing: the safe default, and no claim about the key
        meta.pop(EFFECTS_META, None)
    if any(CANCELLABLE_META in m for m in metas):
        least = min(
            (_cancellable(m.get(CANCELLABLE_META)) for m in metas), key=_LEAST_CANCELLABLE.index
        )
        meta[CANCELLABLE_META] = least.value
    if not all(m.get(TRACKED_META) is True for m in metas):
        meta.pop(TRACKED_META, None)  # a copy whose calls may go unrecorded: none is tracked
    annotations = first.annotations
    hints = [c.annotations.read_only_hint if c.annotations else None for c in copies]
    if annotations is not None and not all(h is True for h in hints):
        annotations = annotations.model_copy(update={"read_only_hint": False})
    return first.model_copy(update={"meta": meta or None, "annotations": annotations})


# -- a listing that changes under the session -------------------------------------------------

_PAGES = 100  # a paginator that never ends cannot hold the listing for ever
CHANGED = "notifications/tools/list_changed"


async def list_all(client: Client) -> list[McpTool]:
    """Every page of the server's ``tools/list``, read from the server (the SDK's response
    cache may hold a listing its server has since changed)."""
    tools: list[McpTool] = []
    cursor: str | None = None
    for _ in range(_PAGES):
        page = await client.list_tools(cursor=cursor, cache_mode="refresh")
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools
    raise NoAnswer(Cause.SERVER_ERROR, f"tools/list still had pages after {_PAGES}")


class Listing:
    """The server's tools as this client knows them, and whether that is still current.

    ``tools`` holds the names of the latest listing, each with the most conservative
    declaration any listing of this session gave it (``conservative`` over time, as over
    copies): a server cannot make a tool a read, or more cancellable, mid-session and have
    the gate follow unseen. ``notice()`` (a ``notifications/tools/list_changed``, seen in
    receive order by the transport tap) makes it stale until a listing fetched after the
    notice is applied; ``fresh()`` waits for that.
    """

    def __init__(self) -> None:
        self.tools: dict[str, McpTool] = {}
        self._seen: dict[str, McpTool] = {}  # every name ever listed, most conservative
        self.notices = 0  # list_changed notifications seen
        self._covered = 0  # the notices the current listing reflects
        self._tried = 0  # the notices a re-list was last attempted for
        self._failed = 0  # the notices the last failed re-list was for
        self.error = ""  # why that re-list failed
        self._moved = anyio.Event()  # set (and replaced) whenever any of the above moves

    @property
    def stale(self) -> bool:
        return self._covered < self.notices

    def _bump(self) -> None:
        self._moved.set()
        self._moved = anyio.Event()

    def on_notice(self, method: str) -> None:
        """A notification the transport read: a tools change makes the listing stale."""
        if method == CHANGED:
            self.notice()

    def notice(self) -> None:
        """The server said its tools changed: stale until listed again."""
        self.notices += 1
        self._bump()

    def apply(self, tools: Iterable[McpTool], covers: int) -> None:
        """A listing fetched after ``covers`` notices: the current tools, never weaker than
        before."""
        listed = index_tools(tools)
        for name, tool in listed.items():
            before = self._seen.get(name)
            merged = tool if before is None else conservative([tool, before])
            if merged.meta != tool.meta or merged.annotations != tool.annotations:
                logger.warning(
                    "stopline: the MCP server's new declaration of tool %r is weaker than an"
                    " earlier one (of this session, or of this server process); the earlier,"
                    " more conservative one is kept",
                    name,
                )
            self._seen[name] = merged
        self.tools = {name: self._seen[name] for name in listed}
        self._covered = max(self._covered, covers)
        self._bump()

    def failed(self, covers: int, why: str) -> None:
        self._failed, self.error = max(self._failed, covers), why
        self._bump()

    async def wanted(self) -> int:
        """Wait for a notice no re-list was tried for; the notices to cover."""
        while self._tried >= self.notices or not self.stale:
            await self._moved.wait()
        self._tried = self.notices
        return self.notices

    async def fresh(self, limit: float) -> str | None:
        """Wait (at most ``limit`` seconds) for a listing that reflects every notice seen
        so far: ``None``, else why there is none."""
        target = self.notices
        with anyio.move_on_after(limit):
            while self._covered < target:
                if self._failed >= target:
                    return f"listing the tools again failed: {self.error}"
                await self._moved.wait()
            return None
        return f"no new tools/list within {limit:g} s of the server's change"

    async def noticed(self, after: int) -> None:
        """Wait until more than ``after`` notices have been seen."""
        while self.notices <= after:
            await self._moved.wait()


class _Limits(Protocol):
    name: str
    connect_timeout: float
    backoff: Backoff


async def follow(
    listing: Listing,
    client: Client,
    apply: Callable[[list[McpTool], int], None],
    limits: _Limits,
) -> None:
    """For as long as ``client``'s connection is up: read the listing again after each
    change notice; on 2026-07-28 also hold the ``subscriptions/listen`` stream the notices
    come on (the server sends them nowhere else)."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(_relist, listing, client, apply, limits)
        if client.protocol_version in MODERN_PROTOCOL_VERSIONS:
            tg.start_soon(_listen, listing, client, limits)


async def _relist(
    listing: Listing,
    client: Client,
    apply: Callable[[list[McpTool], int], None],
    limits: _Limits,
) -> None:
    while True:
        covers = await listing.wanted()
        try:
            with anyio.fail_after(limits.connect_timeout):
                tools = await list_all(client)
        except Exception as exc:  # the connection's end is the client's supervisor's to see
            listing.failed(covers, f"{type(exc).__name__}: {exc}")
            continue
        apply(tools, covers)


async def _listen(listing: Listing, client: Client, limits: _Limits) -> None:
    delays = limits.backoff.delays()
    while True:
        try:
            async with contextlib.AsyncExitStack() as stack:
                with anyio.fail_after(limits.connect_timeout):
                    sub = await stack.enter_async_context(client.listen(tools_list_changed=True))
                if sub.honored is None or not sub.honored.tools_list_changed:
                    logger.info("stopline: MCP server %s sends no tool changes", limits.name)
                    return
                async for _ in sub:  # the transport tap saw each notice first, in order
                    pass
            return  # the server closed the stream: it sends no more
        except SubscriptionLost:
            listing.notice()  # no replay: a change may have been missed, so list again
        except Exception as exc:  # listen not served: the server cannot tell us
            logger.info("stopline: MCP server %s sends no tool changes: %r", limits.name, exc)
            return
        await anyio.sleep(next(delays))
