"""`stopline console` as an operator starts it: typed start-up errors, secrets masked, Ctrl-C."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

import stopline
from stopline.cli import EXIT_ERROR, EXIT_OK, EXIT_USAGE
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


def test_an_address_not_of_this_machine_is_named_as_the_address(tmp_path: Path) -> None:
    """It said the port was the problem ("choose another with --port")."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_ledger, url)
    done = stopline_cli("console", "--host", "192.0.2.1", "--port", "0", ledger=url)
    assert done.returncode == EXIT_ERROR
    assert done.stderr.startswith("stopline: error: address 192.0.2.1 cannot be bound")
    assert done.stderr.strip().endswith("choose another with --host")
    assert "--port" not in done.stderr


def test_an_empty_host_or_an_unusable_principal_is_a_usage_error(tmp_path: Path) -> None:
    """`--host ''` listened on every interface; a `--principal` no ledger records (a
    control character, stopline's own id) started, and then refused every login."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_ledger, url)
    for args, says in (
        (("--host", ""), "invalid host: empty"),
        (("--host", " "), "invalid host: empty"),
        (("--principal", "ops\x01"), "invalid --principal: contains a control character"),
        (("--principal", "stopline"), "invalid --principal: 'stopline' is stopline's own"),
    ):
        done = stopline_cli("console", "--port", "0", *args, ledger=url)
        assert done.returncode == EXIT_USAGE, (args, done.stderr)
        assert done.stderr.startswith(f"stopline: usage: {says}"), (args, done.stderr)
        assert done.stderr.count("\n") == 1 and "open http" not in done.stderr


def test_every_interface_is_said_and_the_address_printed_opens(tmp_path: Path) -> None:
    """`--host 0` (0.0.0.0) printed http://0:PORT/, an address no browser's Host passes."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_ledger, url)
    env = {**os.environ, "STOPLINE_LEDGER": url, "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "stopline.cli", "console", "--host", "0", "--port", "0"]
    with subprocess.Popen(
        [*args, "--token", "tk"], stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        assert proc.stderr is not None
        lines = [proc.stderr.readline()]
        while lines[-1] and not lines[-1].startswith("open "):  # up to the address
            lines.append(proc.stderr.readline())
        try:
            assert len(lines) == 3, lines
            assert lines[0].startswith("stopline console for sqlite:///")
            assert lines[1].startswith("listening on every interface (0.0.0.0)")
            assert lines[2].startswith("open http://127.0.0.1:")
            address = lines[2].strip().removeprefix("open ")
            with httpx.Client(follow_redirects=True) as client:
                assert client.get(address).status_code == 200
        finally:
            proc.send_signal(signal.SIGINT)
            proc.stderr.read()
        assert proc.wait(timeout=30) == EXIT_OK


def test_a_ledger_that_cannot_be_opened_prints_no_address(tmp_path: Path) -> None:
    """A read-only ledger file in a writable directory passed the read-only check; the
    console printed its address, then failed to open it."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    anyio.run(_ledger, url)
    path.chmod(stat.S_IRUSR | stat.S_IRGRP)
    # root writes any file: drop the capabilities that let it, as an operator has none
    unprivileged: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        assert setpriv is not None, "as root this needs util-linux's setpriv"
        drop = "-dac_override,-dac_read_search,-fowner"
        unprivileged = [setpriv, "--bounding-set", drop, "--inh-caps", drop, "--"]
    env = {**os.environ, "STOPLINE_LEDGER": url}
    try:
        done = subprocess.run(
            [*unprivileged, sys.executable, "-m", "stopline.cli", "console", "--port", "0"],
            capture_output=True, text=True, env=env, timeout=60, check=False,
        )  # fmt: skip
    finally:
        path.chmod(stat.S_IRUSR | stat.S_IWUSR)
    assert done.returncode == EXIT_ERROR
    assert done.stderr == (f"stopline: error: ledger {url}: attempt to write a readonly database\n")


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
