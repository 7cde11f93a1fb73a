"""Trace context across MCP: every request of a gated call carries the call's
``traceparent`` in ``_meta`` (tools/call, and tasks/get and the rest when it became a
task), the server's own span continues that trace, and stopline's span has the MCP
SDK's attributes plus stopline's operation id."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import stopline
from stopline.telemetry import ATTR_OP_ID, ATTR_RUN_ID
from tests.mcp.conftest import Server, open_server

pytestmark = pytest.mark.timeout(30)
EXPORTER = InMemorySpanExporter()
PROVIDER = TracerProvider()
PROVIDER.add_span_processor(SimpleSpanProcessor(EXPORTER))


@pytest.fixture(scope="module", params=["stdio-2026", "http-2026", "stdio-legacy"])
async def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Server]:
    transport = str(request.param)
    http = request.getfixturevalue("http_url") if transport.startswith("http") else None
    tmp = tmp_path_factory.mktemp("trace")
    async for opened in open_server(transport, tmp, http, tasks=True, tracer_provider=PROVIDER):
        yield opened


async def test_mcp_trace_context_on_every_request(ledger: stopline.Ledger, server: Server) -> None:
    EXPORTER.clear()
    async with ledger.run("traced", owner="user:1") as run:
        await server.conn.call(run, "upload", {"payload": "t"})
    op = (await ledger.backend.operations(run.id))[0]
    (span,) = [s for s in EXPORTER.get_finished_spans() if s.name == "tools/call upload"]
    attrs = dict(span.attributes or {})
    assert attrs["mcp.method.name"] == "tools/call"
    assert attrs["gen_ai.operation.name"] == "execute_tool"
    assert attrs["gen_ai.tool.name"] == "upload"
    assert attrs[ATTR_OP_ID] == op.id and attrs[ATTR_RUN_ID] == run.id
    assert str(attrs["jsonrpc.request.id"]).isdigit()  # the id the tools/call went out with
    trace_id = format(span.context.trace_id, "032x")

    seen = [t for t in await server.ctl("ctl_traces") if t["trace_id"] == trace_id]
    methods = [t["method"] for t in seen]
    assert "tools/call" in methods
    if server.era == "2026":
        assert "tasks/get" in methods  # the server made it a task: polled in the same trace
    for request in seen:  # the W3C header, in _meta, naming this trace
        assert request["traceparent"].split("-")[1] == trace_id
