"""``stopline console``: the web console (needs the ``console`` extra).

from stopline.console import ConsoleConfig, create_app
app = create_app(ConsoleConfig(url="sqlite:///stopline.db", token="secret"))
"""

from __future__ import annotations

import errno
import socket

import anyio

import stopline
from stopline.console.app import LOCAL_HOSTS, ConsoleConfig, create_app
from stopline.errors import StoplineError

__all__ = ["LOCAL_HOSTS", "ConsoleConfig", "PortUnavailable", "create_app", "listen", "serve"]


class PortUnavailable(StoplineError):
    """The console cannot listen where it was asked to (exit code 1)."""


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, or ``PortUnavailable`` saying why."""
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
        why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be used ({exc.strerror})"
        raise PortUnavailable(f"port {port} on {host} {why}; choose another with --port") from exc
    return sock


def serve(config: ConsoleConfig, sock: socket.socket) -> None:
    """Open the ledger, then serve on ``sock`` until Ctrl-C (uvicorn).

    The ledger opens before the server starts, so a bad ledger is a typed
    error here, not a failed uvicorn start-up.
    """
    import uvicorn

    async def run() -> None:
        async with stopline.open(config.url) as ledger:
            app = create_app(config, ledger=ledger)
            settings = uvicorn.Config(app, log_level="warning", ws="none", lifespan="on")
            await uvicorn.Server(settings).serve(sockets=[sock])

    try:
        anyio.run(run)
    finally:
        sock.close()
