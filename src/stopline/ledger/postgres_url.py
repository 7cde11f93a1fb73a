"""A PostgreSQL ledger's URL: libpq's part, and stopline's own options, each checked.

``schema`` (a plain identifier), ``pool_min`` (0 or more) and ``pool_max`` (1 or
more, not below ``pool_min``), ``retry_for`` (0-86400 seconds) and
``group_commit_ms`` (0-60000). A bad one is refused with ``LedgerUnavailable``
naming it as the URL gave it, before anything connects. The rest of the query
is libpq's, passed on as it is.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import TypedDict

from stopline.errors import LedgerUnavailable
from stopline.ledger import milliseconds_option, seconds_option, whole_option

__all__ = ["OWN_OPTIONS", "Options", "parse"]

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
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query)
    own = {k: v for k, v in query if k in OWN_OPTIONS}
    libpq = [(k, v) for k, v in query if k not in OWN_OPTIONS]
    # percent-encoded as libpq decodes it: ``urlencode``'s default writes a space as
    # "+", which libpq keeps (``options=-c a=1 -c b=2`` reached the server mangled)
    rest = urllib.parse.urlencode(libpq, quote_via=urllib.parse.quote)
    conninfo = urllib.parse.urlunsplit(("postgresql", parts.netloc, parts.path, rest, ""))
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
