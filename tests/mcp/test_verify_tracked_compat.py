"""ADR 0063 across versions: a ``stopline_verify`` of the shape before it.

This module is also the server (``python -m tests.mcp.test_verify_tracked_compat``,
stdio, or ``--fd N`` for Streamable HTTP): a stopline server as built before ADR 0063.
Its ``stopline_verify(key, wait_seconds)`` takes no tool, and says "never saw the key:
not_committed" for any key its record lacks, here for every key of ``pay``, which
records nothing (it declares only ``io.stopline/effects``). ``pay`` commits, then
never answers. A client of ADR 0063 must not believe that "not_committed" for a tool
nobody declared tracked, and must not send the old verify an argument it does not
take.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from mcp.server.context import CallNext, ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

import stopline
from mcp import StdioServerParameters
from stopline import OpStatus
from stopline.integrations.mcp import KEY_META, VERIFY_TOOL, StoplineMCP, ToolPolicy
from stopline.integrations.mcp._verdicts import proves
from stopline.runtime.tool import Verdict
from tests.conftest import FAST_VERIFY
from tests.mcp.conftest import ROOT, TRANSPORTS, cut_under_immediate, serve_http, server_env

NEVER_SAW = {
    "state": "unknown_key",
    "verdict": "not_committed",
    "detail": "this server never saw the key",
    "cancel": "none",
}


def build_old_server() -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer("stopline-before-0063")
    paid: list[str] = []
    committed = anyio.Event()
    verify_arguments: list[dict[str, Any]] = []

    async def keep_arguments(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> Any:
        params = cast(dict[str, Any], ctx.params or {})
        if ctx.method == "tools/call" and params.get("name") == VERIFY_TOOL:
            verify_arguments.append(dict(params.get("arguments") or {}))
        return await call_next(ctx)

    server.middleware.append(keep_arguments)

    @server.tool(meta={"io.stopline/effects": True, "io.stopline/cancellable": "until_accepted"})
    async def pay(amount: int, ctx: Context[Any]) -> dict[str, Any]:
        """Commits (kept in ``paid``, not in any verify record), then never answers."""
        paid.append(str(cast(dict[str, Any], ctx.request_context.meta or {}).get(KEY_META)))
        committed.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    @server.tool(
        name=VERIFY_TOOL,
        annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True),
        meta={"io.stopline/effects": False},
    )
    async def stopline_verify(key: str, wait_seconds: float = 0.0) -> dict[str, Any]:
        return {"key": key, **NEVER_SAW}

    @server.tool(meta={"io.stopline/effects": False})
    async def ctl_paid() -> dict[str, Any]:
        """Waits until ``pay`` has committed; what was paid and what verify was asked."""
        await committed.wait()
        return {"paid": paid, "verify_arguments": verify_arguments}

    return server


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int)
    args = parser.parse_args(argv)
    server = build_old_server()
    if args.fd is None:
        server.run("stdio")
        return
    import uvicorn

    uvicorn.run(server.streamable_http_app(), fd=args.fd, log_level="warning")


# -- the tests ---------------------------------------------------------------------------------
@pytest.fixture(params=TRANSPORTS)
async def old(request: pytest.FixtureRequest) -> AsyncIterator[StoplineMCP]:
    kind, era = str(request.param).split("-")
    mode = "legacy" if era == "legacy" else "2026-07-28"
    module = ["-m", "tests.mcp.test_verify_tracked_compat"]
    if kind == "stdio":
        params = StdioServerParameters(
            command=sys.executable, args=module, cwd=str(ROOT), env=server_env()
        )
        async with StoplineMCP(params, mode=mode, name="old") as conn:
            yield conn
        return
    with serve_http(*module) as url:
        async with StoplineMCP(url, mode=mode, name="old") as conn:
            yield conn


async def ctl_paid(conn: StoplineMCP) -> dict[str, Any]:
    result = await conn.client.call_tool("ctl_paid", {})
    assert isinstance(result.structured_content, dict), result
    return result.structured_content


async def test_an_old_servers_never_saw_is_not_believed_for_an_undeclared_tool(
    old: StoplineMCP, tmp_path: Path
) -> None:
    async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger:
        receipt, op = await cut_under_immediate(
            ledger,
            "cut-old-pay",
            lambda run: old.call(run, "pay", {"amount": 5}, key="pay"),
            lambda: ctl_paid(old),  # the effect happened; no answer will come
        )
        truth = await ctl_paid(old)
    assert truth["paid"] == [op.id]
    # it was asked (the old server's verify is the read-back) and said "not_committed"
    assert truth["verify_arguments"], "the old server's verify was never asked"
    # the old verify takes no tool: none was sent; a wait it can take
    assert all(set(a) == {"key", "wait_seconds"} for a in truth["verify_arguments"])
    assert op.status is OpStatus.NEEDS_REVIEW, receipt.text()  # before: not_committed


def test_what_a_verify_answer_proves() -> None:
    """``proves``: "no record" is believed only for a tool known to be tracked."""
    new = {"key": "k", **NEVER_SAW, "tracked": True, "tool": "pay"}
    assert proves(new, "pay", True)[0] is Verdict.NOT_COMMITTED
    assert proves(new, "pay", None)[0] is Verdict.NOT_COMMITTED  # the server says so
    assert proves(new, "pay", False)[0] is Verdict.UNKNOWN  # the client says it is not
    assert proves(new, "other", True)[0] is Verdict.UNKNOWN  # it answered for another tool
    assert proves({**new, "tracked": False}, "pay", True)[0] is Verdict.UNKNOWN
    unnamed = {"key": "k", **NEVER_SAW, "tracked": True}  # a verify that named no tool
    assert proves(unnamed, "pay", True)[0] is Verdict.UNKNOWN
    before = {"key": "k", **NEVER_SAW}  # a server from before ADR 0063
    assert proves(before, "pay", None)[0] is Verdict.UNKNOWN
    assert proves(before, "pay", True)[0] is Verdict.NOT_COMMITTED  # ToolPolicy(tracked=True)
    recorded = {"key": "k", "state": "not_committed", "verdict": "not_committed"}
    assert proves(recorded, "pay", None)[0] is Verdict.NOT_COMMITTED  # from a record
    assert proves({"verdict": "committed"}, "pay", None)[0] is Verdict.COMMITTED
    assert proves({"verdict": "maybe"}, "pay", True)[0] is Verdict.UNKNOWN
    assert ToolPolicy(tracked=True).merged(ToolPolicy()).tracked is True


if __name__ == "__main__":
    main(sys.argv[1:])
