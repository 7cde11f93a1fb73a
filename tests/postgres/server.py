"""The PostgreSQL server the tests use, and a fresh schema per test.

``STOPLINE_TEST_POSTGRES`` names the server (default
``postgresql://127.0.0.1:5432/test``). Without a server the tests that need
one skip, saying how to point them at one; in CI (``CI=true``) they fail.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import psycopg

    from stopline.ledger.postgres import PostgresBackend

DEFAULT = "postgresql://127.0.0.1:5432/test"
ENV = "STOPLINE_TEST_POSTGRES"


def server_url() -> str:
    return os.environ.get(ENV) or DEFAULT


@functools.cache
def _unreachable() -> str | None:
    """Why the server cannot be used, or None."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install -e '.[dev]')"
    try:
        with psycopg.connect(server_url(), connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return f"no PostgreSQL at {server_url()} ({str(exc).strip().splitlines()[0]})"
    return None


def require_server() -> str:
    """The server's URL; skips the test (fails it in CI) when there is none."""
    why = _unreachable()
    if why is not None:
        message = f"{why}; set {ENV}=postgresql://USER@HOST:PORT/DB to run these tests"
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return server_url()


def with_schema(url: str, schema: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}schema={schema}"


def drop_schema(schema: str) -> None:
    import psycopg

    with psycopg.connect(server_url(), autocommit=True, connect_timeout=3) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def fresh_schema() -> Iterator[str]:
    """A ledger URL in a schema of its own, dropped afterwards (tests run in parallel)."""
    url = require_server()
    schema = f"t_{uuid.uuid4().hex[:16]}"
    try:
        yield with_schema(url, schema)
    finally:
        drop_schema(schema)


def terminate(conninfo: str, pid: int) -> None:
    """The server ends the connection of process ``pid`` (an administrator, a failover)."""
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


class Outage:
    """The server, as one backend sees it, going down and coming back.

    ``begin(*pids)``: the server ends those connections (for real,
    ``pg_terminate_backend``) and refuses new ones: every checkout from the pool
    and every connect of the group commit's reserved connection fails, as a
    server that is down makes them fail. ``end()``: reachable again."""

    def __init__(self, backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.down = False
        self._conninfo = backend.conninfo
        checkout = backend.pool.connection
        connect = backend.group.reserved.connect

        def refused() -> psycopg.OperationalError:
            import psycopg

            return psycopg.OperationalError("simulated: connection refused")

        def pool_connection(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                raise refused()
            return checkout(*args, **kwargs)

        async def reserved_connect() -> psycopg.AsyncConnection[Any]:
            if self.down:
                raise refused()
            return await connect()

        monkeypatch.setattr(backend.pool, "connection", pool_connection)
        monkeypatch.setattr(backend.group.reserved, "connect", reserved_connect)

    def begin(self, *pids: int) -> None:
        for pid in pids:
            terminate(self._conninfo, pid)
        self.down = True

    def end(self) -> None:
        self.down = False
