"""The truth server's tools kept the way stopline's server-side helpers advise.

``python tests/support/thirdparty_mcp_server.py --stopline-effects PATH`` builds
the same payments server, but each effect goes through
``stopline.integrations.mcp.Effects``: recorded by its ``_meta`` key before the
answer, ``stopline_verify`` offered as the read-back, every cancel the server
sees logged, and each tool's ``_meta`` saying how it cancels. The ground-truth
log is written exactly as for the third-party server, so the matrix judges both
columns against the same truth.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import Context, MCPServer

from stopline.domain.vocab import Cancellable
from stopline.integrations.mcp import Effects, effect_meta

Payment = dict[str, Any]
Commit = Callable[[Callable[[], Payment]], Awaitable[Payment]]

__all__ = ["Keeper"]


class Keeper:
    """Wraps the server's tool bodies in ``Effects`` (see thirdparty_mcp_server)."""

    def __init__(self, path: str | Path) -> None:
        self.effects = Effects(path)

    def install(self, server: MCPServer[Any]) -> None:
        self.effects.install(server)

    @staticmethod
    def meta(shielded: bool) -> dict[str, Any]:
        """A tool that cannot be stopped once received says so (``never``)."""
        return effect_meta(Cancellable.NEVER if shielded else Cancellable.UNTIL_ACCEPTED)

    async def keep(
        self,
        ctx: Context[Any],
        tool: str,
        body: Callable[[Commit], Awaitable[Payment]],
        *,
        shielded: bool,
    ) -> Payment:
        """Run ``body`` as one keyed effect; ``body`` commits through the commit it is given."""
        cancellable = Cancellable.NEVER if shielded else Cancellable.UNTIL_ACCEPTED
        async with self.effects.operation(ctx, tool, cancellable) as op:
            if op.replayed:
                result: Payment = op.result
                return result
            return await body(op.commit)

    def keep_sync(self, ctx: Context[Any], tool: str, body: Callable[[], Payment]) -> Payment:
        """In a ``def`` tool's worker thread: the whole body is one recorded commit."""
        return self.effects.run_sync(ctx, tool, body)
