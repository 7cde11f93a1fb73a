"""`stopline console` as an operator starts it: typed start-up errors, secrets masked, Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

import stopline
from stopline.cli import EXIT_ERROR, EXIT_OK
from tests.postgres.server import drop_schema, require_server, with_schema
from tests.surfaces.test_cli import stopline_cli

SECRET = "s3cret-pw"


def test_a_bad_ledger_is_a_typed_error_before_anything_listens(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE accounts (id INTEGER)")
    before = path.read_bytes()
    done = stopline_cli("console", "--port", "0", ledger=f"sqlite:///{path}")
    assert done.returncode == EXIT_ERROR
    assert done.stderr.strip().endswith("not a stopline ledger (foreign tables found)")
    assert "Traceback" not in done.stderr and path.read_bytes() == before


def test_a_busy_port_is_a_typed_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_ledger, url)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = stopline_cli("console", "--port", str(port), ledger=url)
    assert done.returncode == EXIT_ERROR
    assert done.stderr == (
        f"stopline: error: port {port} on 127.0.0.1 is in use; choose another with --port\n"
    )


def test_a_host_that_is_no_address_here_is_named_as_the_host(tmp_path: Path) -> None:
    """The refusal said "choose another with --port" for a host that did not resolve."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_ledger, url)
    done = stopline_cli("console", "--host", "no-such-host.invalid", "--port", "0", ledger=url)
    assert done.returncode == EXIT_ERROR
    assert done.stderr.startswith("stopline: error: host no-such-host.invalid is not an address")
    assert done.stderr.strip().endswith("choose another with --host")


async def _ledger(url: str) -> None:
    async with stopline.open(url) as ledger, ledger.run("x", owner="user:ada"):
        pass


@pytest.fixture
def pg_with_password() -> Iterator[str]:
    server = require_server()
    schema = f"t_{uuid.uuid4().hex[:16]}"
    user = httpx.URL(server).username or "root"
    url = with_schema(server.replace("://", f"://{user}:{SECRET}@", 1), schema)
    anyio.run(_ledger, url)
    try:
        yield url
    finally:
        drop_schema(schema)


def test_the_password_is_masked_at_start_and_on_every_page(pg_with_password: str) -> None:
    env = {**os.environ, "STOPLINE_LEDGER": pg_with_password, "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "stopline.cli", "console", "--port", "0", "--token", "tk"]
    with subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        opened = proc.stderr.readline()
        try:
            assert first.startswith("stopline console for postgresql://")
            assert ":***@" in first and SECRET not in first
            address = opened.strip().removeprefix("open ")
            with httpx.Client(follow_redirects=True) as client:
                for path in ("", "stats", "review"):
                    page = client.get(address.replace("/?token=tk", f"/{path}?token=tk"))
                    assert page.status_code == 200
                    assert ":***@" in page.text and SECRET not in page.text
        finally:
            proc.send_signal(signal.SIGINT)
            rest = proc.stderr.read()
        assert proc.wait(timeout=30) == EXIT_OK
    assert "stopline console stopped" in rest and "Traceback" not in rest
    assert SECRET not in first + opened + rest
