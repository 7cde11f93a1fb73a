"""A span processor that raises (the OpenTelemetry SDK runs processors inline, in the
caller's code) fails no MCP call (ADR 0077): the client's ``tools/call`` span is
started and ended quietly, as telemetry's own spans are. Before, a processor raising
at the span's start failed the call after its gate passed, nothing sent, and one
raising at its end turned an answered call into an error."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider

import stopline
from stopline import OpStatus
from tests.mcp.conftest import Server, open_server

pytestmark = pytest.mark.timeout(30)


class Raising(SpanProcessor):
    """Raises at the start or the end of the client's ``tools/call`` spans."""

    def __init__(self) -> None:
        self.at = ""

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if self.at == "start" and span.name.startswith("tools/call"):
            raise RuntimeError("a processor broke at start")

    def on_end(self, span: ReadableSpan) -> None:
        if self.at == "end" and span.name.startswith("tools/call"):
            raise RuntimeError("a processor broke at end")


RAISING = Raising()
PROVIDER = TracerProvider()
PROVIDER.add_span_processor(RAISING)


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    tmp = tmp_path_factory.mktemp("raising")
    async for opened in open_server("stdio-2026", tmp, None, tracer_provider=PROVIDER):
        yield opened


@pytest.mark.parametrize("at", ["start", "end"])
async def test_a_span_processor_that_raises_fails_no_call(
    ledger: stopline.Ledger, server: Server, at: str
) -> None:
    RAISING.at = at
    try:
        async with ledger.run("traced", owner="user:1") as run:
            answer: Any = await server.conn.call(run, "upload", {"payload": at})
    finally:
        RAISING.at = ""
    op = (await ledger.backend.operations(run.id))[0]
    assert answer is not None
    assert op.status is OpStatus.COMMITTED
