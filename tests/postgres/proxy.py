"""A TCP relay between a ledger and the server that can stop relaying without closing.

A server that stops answering while its socket stays open (a frozen backend, a
paused host, a network that drops packets) looks, from the client, exactly like a
relay that keeps what it reads: the client's statement is sent and acknowledged, and
no answer comes. ``freeze()`` holds every connection open now (their bytes kept, not
lost); ``refuse`` closes new connections at once (a server unreachable for new
sessions); ``thaw()`` relays what was held and goes on. ``drained()`` returns once
every held connection that had bytes on the way has ended: what it held reached
the server and was answered (or refused by a session gone).

A server that stops answering after a client connected: ``hold_new = "connect"`` holds
each connection accepted while it is set from its first byte (the TCP connect
succeeds, the session never starts); ``hold_new = "ready"`` relays each one's start,
then holds it once the server said it is ready for its first statement (the session
open, every statement of it unanswered). ``freeze(pid=...)`` holds one connection
only: the one whose server process is ``pid`` (``pids``, read from the server's
BackendKeyData at the start, as ``conn.info.backend_pid`` says it). Both read the
start of the server's stream, so the relayed URL must not use TLS (the test server
does not).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Literal

from tests.postgres.server import server_url

# the server's messages at a session's start that the relay reads (protocol 3.0):
# BackendKeyData (its process id, then its secret) and ReadyForQuery (the start done)
_KEY_DATA = b"K\x00\x00\x00\x0c"
_READY = b"Z\x00\x00\x00\x05"
Hold = Literal["connect", "ready"]


class Relay:
    def __init__(self) -> None:
        self.refuse = False
        self.hold_new: Hold | None = None  # connections accepted now: held (see above)
        self.pids: dict[int, asyncio.Task[None]] = {}  # server process -> its connection
        self._live: set[asyncio.Task[None]] = set()  # one per connection relayed
        self._frozen: set[asyncio.Task[None]] = set()  # those held
        self._holding: set[asyncio.Task[None]] = set()  # those held with bytes on the way
        self._held = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def freeze(self, *, pid: int | None = None) -> None:
        """Connections open now relay nothing more until ``thaw``; later ones are not held.
        ``pid``: only the connection of that server process."""
        self._frozen = set(self._live) if pid is None else {self.pids[pid]}
        self._held = asyncio.Event()

    def hold(self, connection: asyncio.Task[None]) -> None:
        """Hold ``connection`` too, with those frozen now (one ``thaw`` for all)."""
        if not self._frozen or self._held.is_set():
            self._frozen, self._held = set(), asyncio.Event()
        self._frozen.add(connection)

    def thaw(self) -> None:
        self._held.set()

    async def drained(self) -> None:
        """Every held connection that had bytes on the way has ended: its client gave up
        on it (a statement unanswered), so once what it held reached the server and the
        server answered it (or had ended the session), the relay ends."""
        await asyncio.gather(*self._holding, return_exceptions=True)

    async def wait_if_held(self, connection: asyncio.Task[None]) -> None:
        if connection in self._frozen and not self._held.is_set():
            self._holding.add(connection)
            await self._held.wait()

    async def close(self) -> None:
        self._held.set()
        if self._server is not None:
            self._server.close()
        for task in list(self._live):
            task.cancel()
        await asyncio.gather(*self._live, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refuse:
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._live.add(task)
        hold = self.hold_new
        if hold == "connect":
            self.hold(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*_server_address())
            try:
                start = _Start(self, task, hold == "ready")
                await asyncio.gather(
                    _pump(reader, up_writer, self, task),
                    _pump(up_reader, writer, self, task, start.read),
                )
            finally:
                up_writer.close()
        except (OSError, asyncio.CancelledError):
            pass  # the relay closed (a task of ``start_server``'s: nobody awaits it)
        finally:
            writer.close()
            self._live.discard(task)


class _Start:
    """The start of a session as the server sends it: its process id, and when it is
    ready for the first statement (then held, if asked)."""

    def __init__(self, relay: Relay, connection: asyncio.Task[None], hold: bool) -> None:
        self._relay = relay
        self._connection = connection
        self._hold = hold
        self._seen: bytes | None = b""  # the server's bytes until it is ready (a few hundred)

    def read(self, data: bytes) -> None:
        if self._seen is None:
            return
        seen = self._seen + data
        at = seen.find(_KEY_DATA)
        if at >= 0 and len(seen) >= at + 9:
            self._relay.pids[int.from_bytes(seen[at + 5 : at + 9], "big")] = self._connection
        if seen.find(_READY) < 0:
            self._seen = seen
            return
        self._seen = None
        if self._hold:  # before the client reads that it is ready: its first statement waits
            self._relay.hold(self._connection)


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    relay: Relay,
    connection: asyncio.Task[None],
    read: Callable[[bytes], None] | None = None,
) -> None:
    """One direction, to its end: read until the sender closes, relaying what the other
    side still takes; then half-close, so the other side answers what it has before
    it closes too (the connection ends once the server has ended the session). ``read``
    sees each piece before it is relayed."""
    alive = True
    try:
        while data := await reader.read(65536):
            await relay.wait_if_held(connection)
            if read is not None:  # before the other side has it (and answers it)
                read(data)
            if alive:
                try:
                    writer.write(data)
                    await writer.drain()
                except OSError:
                    alive = False  # the other side gone: read on to the sender's end
        if alive and writer.can_write_eof():
            writer.write_eof()
    except OSError:
        pass


def _server_address() -> tuple[str, int]:
    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(server_url())
    return str(info.get("host") or "127.0.0.1"), int(info.get("port") or 5432)


@contextlib.asynccontextmanager
async def relayed(url: str) -> AsyncIterator[tuple[Relay, str]]:
    """A relay to the test server, and ``url`` (a ledger URL on that server) through it."""
    relay = Relay()
    port = await relay.start()
    host, real = _server_address()
    try:
        yield relay, url.replace(f"{host}:{real}", f"127.0.0.1:{port}", 1)
    finally:
        await relay.close()
