"""The shared Temporal dev server helper: a real server on a free loopback port."""

from __future__ import annotations

from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client

from stopline.integrations.temporal_server import _accepts, temporal_dev_server


async def test_dev_server_serves_clients_then_stops() -> None:
    async with temporal_dev_server() as server:
        assert server.host == "127.0.0.1"
        client = await Client.connect(server.address, namespace=server.namespace)
        info = await client.workflow_service.get_system_info(GetSystemInfoRequest())
        assert info.server_version
    assert not await _accepts(server.host, server.port)
