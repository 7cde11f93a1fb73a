"""A real headless Chromium (Debian's) and the console served in-process.

``make browser`` installs Chromium. Without it the browser tests skip on a
user's machine and fail in CI (``CI=true``), so a missing install step shows.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
import uvicorn

from stopline.console import ConsoleConfig, create_app

__all__ = ["CHROMIUM", "CHROMIUM_ARGS", "console_server", "require_chromium"]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_missing() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} not found: run 'make browser' (installs Debian's chromium)"
    return None


def require_chromium() -> None:
    missing = chromium_missing()
    if missing is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(missing)
    pytest.skip(missing)


@asynccontextmanager
async def console_server(url: str, token: str) -> AsyncIterator[str]:
    """Serve the console on 127.0.0.1 and a free port; yields its base address.

    The socket listens before uvicorn starts, so a request made at once waits
    in the backlog instead of racing the start-up.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    app = create_app(ConsoleConfig(url=url, token=token))
    config = uvicorn.Config(app, log_level="warning", ws="none", lifespan="on")
    server = uvicorn.Server(config)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            try:
                yield f"http://127.0.0.1:{port}"
            finally:
                server.should_exit = True
    finally:
        sock.close()
