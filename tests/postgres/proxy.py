"""A TCP relay between a ledger and the server that can stop relaying without closing.

A server that stops answering while its socket stays open (a frozen backend, a
paused host, a network that drops packets) looks, from the client, exactly like a
relay that keeps what it reads: the client's statement is sent and acknowledged, and
no answer comes. ``freeze()`` holds every connection open now (their bytes kept, not
lost); ``refuse`` closes new connections at once (a server unreachable for new
sessions); ``thaw()`` relays what was held and goes on. ``drained()`` returns once
every held connection that had bytes on the way has ended: what it held reached
the server and was answered (or refused by a session gone).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from tests.postgres.server import server_url


class Relay:
    def __init__(self) -> None:
        self.refuse = False
        self._live: set[asyncio.Task[None]] = set()  # one per connection relayed
        self._frozen: set[asyncio.Task[None]] = set()  # those held
        self._holding: set[asyncio.Task[None]] = set()  # those held with bytes on the way
        self._held = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def freeze(self) -> None:
        """Connections open now relay nothing more until ``thaw``; later ones are not held."""
        self._frozen = set(self._live)
        self._held = asyncio.Event()

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
        try:
            up_reader, up_writer = await asyncio.open_connection(*_server_address())
            try:
                await asyncio.gather(
                    _pump(reader, up_writer, self, task), _pump(up_reader, writer, self, task)
                )
            finally:
                up_writer.close()
        except (OSError, asyncio.CancelledError):
            pass  # the relay closed (a task of ``start_server``'s: nobody awaits it)
        finally:
            writer.close()
            self._live.discard(task)


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    relay: Relay,
    connection: asyncio.Task[None],
) -> None:
    """One direction, to its end: read until the sender closes, relaying what the other
    side still takes; then half-close, so the other side answers what it has before
    it closes too (the connection ends once the server has ended the session)."""
    alive = True
    try:
        while data := await reader.read(65536):
            await relay.wait_if_held(connection)
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
