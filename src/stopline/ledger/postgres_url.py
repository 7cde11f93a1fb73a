"""A PostgreSQL ledger's URL: libpq's part, and stopline's own options, each checked.

``schema`` (a plain identifier), ``pool_min`` (0 or more) and ``pool_max`` (1 or
more, not below ``pool_min``), ``retry_for`` (0-86400 seconds) and
``group_commit_ms`` (0-60000). A bad one (or one given twice, or blank) is
refused with ``LedgerUnavailable`` naming it as the URL gave it, before anything
connects. The rest of the query is libpq's, passed on as it is; a URL libpq
refuses to read (a parameter it does not know) or that does not parse is
refused the same way.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import TypedDict

import psycopg
from psycopg.conninfo import conninfo_to_dict

from stopline.errors import LedgerUnavailable
from stopline.ledger import milliseconds_option, seconds_option, url_options, whole_option

__all__ = ["OWN_OPTIONS", "SESSION", "Options", "parse", "session_options"]

OWN_OPTIONS = frozenset({"schema", "pool_min", "pool_max", "retry_for", "group_commit_ms"})
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,40}")


class Options(TypedDict):
    """stopline's own options, as ``PostgresBackend`` takes them."""

    schema: str | None
    pool_min: int
    pool_max: int
    retry_for: float
    group_commit_ms: float


def parse(url: str, where: str) -> tuple[str, Options]:
    """``url``'s connection string for libpq and stopline's options from it (``where``:
    the URL as errors name it, its password hidden)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL" and the like
        raise LedgerUnavailable(where, f"not a valid URL: {exc}") from None
    own, theirs = url_options(url, where, OWN_OPTIONS, parts.query)
    libpq = [(k, v) for k, v in theirs if v]  # a blank one is libpq's default, as before
    # percent-encoded as libpq decodes it: ``urlencode``'s default writes a space as
    # "+", which libpq keeps (``options=-c a=1 -c b=2`` reached the server mangled)
    rest = urllib.parse.urlencode(libpq, quote_via=urllib.parse.quote)
    conninfo = urllib.parse.urlunsplit(("postgresql", parts.netloc, parts.path, rest, ""))
    try:  # what libpq itself refuses (a parameter it does not know), named here
        conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as exc:
        raise LedgerUnavailable(where, f"libpq refuses the URL: {str(exc).strip()}") from None
    schema = own.get("schema")
    if schema is not None and not _IDENT.fullmatch(schema):
        raise LedgerUnavailable(where, f"schema {schema!r} is not a plain identifier")
    pool_min = whole_option(where, "pool_min", own.get("pool_min", "1"), low=0)
    pool_max = whole_option(where, "pool_max", own.get("pool_max", "10"), low=1)
    if pool_max < pool_min:
        raise LedgerUnavailable(where, f"pool_max={pool_max} is below pool_min={pool_min}")
    retry_for = seconds_option(where, "retry_for", own.get("retry_for", "10"))
    group_ms = milliseconds_option(where, "group_commit_ms", own.get("group_commit_ms", "2"))
    options = Options(
        schema=schema,
        pool_min=pool_min,
        pool_max=pool_max,
        retry_for=retry_for,
        group_commit_ms=1000 * group_ms,
    )
    return conninfo, options


# Every session of a ledger: no JIT, no parallel workers. Each statement reaches a few
# rows through an index (tests/postgres/test_workload_plans.py), so either comes only
# of a misestimate on tables not analyzed, and costs more than the statement: a
# receipt's read of a small tree went parallel, 7 ms instead of 0.3 (ADR 0046)
SESSION = "-c jit=off -c max_parallel_workers_per_gather=0"


def session_options(conninfo: str, schema: str | None, read_only: bool, lock_wait: float) -> str:
    """libpq's ``options`` for a ledger's session: ours, a row waited for ``lock_wait``
    seconds at most, then the URL's own (kept: they were replaced when these were
    given; a setting it repeats is the URL's)."""
    options = [SESSION]
    if schema:
        options.append(f"-c search_path={schema}")
    if read_only:
        options.append("-c default_transaction_read_only=on")
    options.append(f"-c lock_timeout={round(lock_wait * 1000)}")
    if theirs := conninfo_to_dict(conninfo).get("options"):
        options.append(str(theirs))
    return " ".join(options)
