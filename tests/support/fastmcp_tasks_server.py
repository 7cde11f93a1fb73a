"""A FastMCP 4.1 server with ``fastmcp-tasks`` background tasks (SEP-2663): an
implementation stopline did not write, for the interop tests.

    python -m tests.support.fastmcp_tasks_server [--http PORT | --fd FD]

``quick(payload)`` returns at once; ``stuck(payload)`` waits for an event nobody sets,
so only a cancel ends it. Both are ``task=True`` (optional): FastMCP runs them as
tasks when the client declares the extension. The task backend is Docket's
``memory://`` (one process).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys

import anyio
from fastmcp import FastMCP
from fastmcp.utilities.tasks import TaskConfig
from fastmcp_tasks import TasksExtension

__all__ = ["build", "main"]

FAST = TaskConfig(mode="optional", poll_interval=dt.timedelta(milliseconds=20))


def build() -> FastMCP:
    server = FastMCP("fastmcp-tasks-interop")
    server.add_extension(TasksExtension(url="memory://"))
    never = anyio.Event()

    @server.tool(task=FAST)
    async def quick(payload: str) -> dict[str, str]:
        """Returns its payload."""
        return {"value": payload}

    @server.tool(task=FAST)
    async def stuck(payload: str) -> dict[str, str]:
        """Waits until cancelled."""
        await never.wait()
        return {"value": payload}

    return server


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.fastmcp_tasks_server")
    parser.add_argument("--http", type=int)
    parser.add_argument("--fd", type=int)
    args = parser.parse_args(argv)
    server = build()
    if args.fd is not None or args.http:
        import uvicorn

        app = server.http_app(path="/mcp")
        if args.fd is not None:
            uvicorn.run(app, fd=args.fd, log_level="warning")
        else:
            uvicorn.run(app, host="127.0.0.1", port=args.http, log_level="warning")
    else:
        server.run("stdio", show_banner=False)


if __name__ == "__main__":
    main(sys.argv[1:])
