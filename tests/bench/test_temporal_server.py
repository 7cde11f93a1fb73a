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


async def test_ready_means_a_client_connects_at_once() -> None:
    """The frontend accepts TCP before it is healthy; the helper yields only after a
    client's first call succeeds (a peers bench under load failed on "Frontend is not
    healthy yet")."""
    async with temporal_dev_server() as server:
        for _ in range(3):
            client = await Client.connect(server.address, namespace=server.namespace)
            assert await client.workflow_service.get_system_info(GetSystemInfoRequest())
