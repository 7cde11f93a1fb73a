"""``stopline console``: the web console (needs the ``console`` extra).

from stopline.console import ConsoleConfig, create_app
app = create_app(ConsoleConfig(url="sqlite:///stopline.db", token="secret"))
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Callable

import anyio

import stopline
from stopline.console.app import LOCAL_HOSTS, ConsoleConfig, check_principal, create_app
from stopline.errors import InvalidInput, StoplineError

__all__ = [
    "LOCAL_HOSTS",
    "ConsoleConfig",
    "PortUnavailable",
    "check_principal",
    "create_app",
    "every_interface",
    "listen",
    "local_url",
    "serve",
]


class PortUnavailable(StoplineError):
    """The console cannot listen where it was asked to (exit code 1)."""


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, or a typed error saying why: ``InvalidInput``
    for an empty host, ``PortUnavailable`` naming what failed (the host, the address or
    the port).

    An empty host is refused: the socket layer reads it as every interface, the
    opposite of leaving the option out (127.0.0.1). Every interface is only ever
    asked for by name (``0.0.0.0``, ``::``)."""
    if not host.strip():
        raise InvalidInput(
            "host",
            "empty: name the interface to listen on (127.0.0.1 by default; 0.0.0.0 "
            "listens on every one, knowingly)",
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except socket.gaierror as exc:  # the host, not the port: no such name or address
        sock.close()
        raise PortUnavailable(
            f"host {host} is not an address here ({exc.strerror}); choose another with --host"
        ) from exc
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            why = f"port {port} on {host} is in use; choose another with --port"
        elif exc.errno == errno.EADDRNOTAVAIL:  # the address, not the port
            why = (
                f"address {host} cannot be bound ({exc.strerror}): it is not an address "
                "of this machine; choose another with --host"
            )
        else:
            why = f"cannot listen on {host} port {port} ({exc.strerror})"
        raise PortUnavailable(why) from exc
    return sock


def every_interface(sock: socket.socket) -> bool:
    """Whether ``sock`` listens on every interface (``0.0.0.0`` or ``::``, however the
    host was spelled: ``0`` is ``0.0.0.0`` too)."""
    return ipaddress.ip_address(str(sock.getsockname()[0]).partition("%")[0]).is_unspecified


def local_url(sock: socket.socket) -> str:
    """Where a browser on this machine opens the console listening on ``sock``: the
    address it is bound to, or the loopback one when that is every interface (no
    browser's Host names ``0.0.0.0``, and the console answers only to its hosts)."""
    host, port = sock.getsockname()[:2]
    if every_interface(sock):
        host = "::1" if sock.family == socket.AF_INET6 else "127.0.0.1"
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


def serve(
    config: ConsoleConfig, sock: socket.socket, *, ready: Callable[[], None] = lambda: None
) -> None:
    """Open the ledger, call ``ready()``, then serve on ``sock`` until Ctrl-C (uvicorn).

    The ledger opens before the server starts, so a bad ledger is a typed
    error here, not a failed uvicorn start-up; ``ready`` (where the command prints
    the address to open) runs only once it is open.
    """
    import uvicorn

    async def run() -> None:
        async with stopline.open(config.url) as ledger:
            ready()
            app = create_app(config, ledger=ledger)
            settings = uvicorn.Config(app, log_level="warning", ws="none", lifespan="on")
            await uvicorn.Server(settings).serve(sockets=[sock])

    try:
        anyio.run(run)
    finally:
        sock.close()
