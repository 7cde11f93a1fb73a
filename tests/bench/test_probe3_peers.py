"""`stopline bench --peers --postgres URL`: DBOS's database on that server, and a DBOS
child that fails, seen from outside with the real server and the real DBOS.

Before, DBOS's database URL was the server's URL cut at its last ``/``: a URL naming
no database (``postgresql://host:5432``, which libpq and the bench's own check take)
became ``postgresql://stopline_bench_dbos_...`` (the database's name as the host),
and a URL with options lost them. The child then failed, and its
``CalledProcessError`` reached the terminal as a traceback after every other figure
had been measured, printing the command line with the URL, password and all.
"""

from __future__ import annotations

import urllib.parse
import uuid

import psycopg
import pytest

from stopline.bench import peers
from tests.postgres.server import require_server


def _without_database(url: str) -> str:
    scheme, netloc, _path, _query, _fragment = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((scheme, netloc, "", "", ""))


@pytest.mark.parametrize("options", ["", "?application_name=bench-probe"])
def test_dbos_database_url_is_the_servers_with_that_database(options: str) -> None:
    server = _without_database(require_server()) + options
    name = f"stopline_probe3_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        with psycopg.connect(peers.database_url(server, name)) as conn:
            row = conn.execute(
                "SELECT current_database(), current_setting('application_name')"
            ).fetchone()
        assert row is not None and row[0] == name
        if options:
            assert row[1] == "bench-probe"  # the server URL's options kept
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.timeout(120)
async def test_a_dbos_child_that_fails_is_one_line_naming_it_without_the_password() -> None:
    """A failure the CLI prints as one line (an ``OSError``), naming DBOS and the
    exception its child died of, with the URL's password masked. (A database that does
    not exist DBOS makes itself: a server nothing listens on fails it.)"""
    url = "postgresql://postgres:s3cret-pw@127.0.0.1:1/bench"
    with pytest.raises(ChildProcessError) as caught:
        await peers._dbos_samples(url, 5)
    said = str(caught.value)
    assert said.startswith("peer DBOS on postgresql://postgres:***@127.0.0.1:1/bench failed")
    assert "OperationalError" in said and "Connection refused" in said  # the cause
    assert "s3cret-pw" not in said
    assert "\n" not in said
