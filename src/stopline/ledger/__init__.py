"""Storage: the backend seam and the backends, chosen by URL and imported lazily."""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path

from stopline.errors import InvalidInput, LedgerCorrupt, LedgerUnavailable
from stopline.ledger._redeliver import surface_rearmed
from stopline.ledger.backend import Backend

__all__ = [
    "DEFAULT_URL",
    "MAX_WAIT_S",
    "Backend",
    "milliseconds_option",
    "number_option",
    "open_backend",
    "redact",
    "resolve_url",
    "seconds_option",
    "surface_rearmed",
    "tables_gone",
    "url_options",
    "whole_option",
]

DEFAULT_URL = "sqlite:///stopline.db"
ENV_VAR = "STOPLINE_LEDGER"


def resolve_url(url: str | None) -> str:
    """The URL given, else ``$STOPLINE_LEDGER``, else ``sqlite:///stopline.db``. A URL
    given blank is refused (``InvalidInput``): it opened the default ledger, another
    one than the caller named."""
    if url is not None and not url.strip():
        raise InvalidInput("ledger URL", "it is empty: name a ledger, or leave it out")
    return url or os.environ.get(ENV_VAR) or DEFAULT_URL


_USERINFO_PASSWORD = re.compile(r"(//[^/@:]*:)[^/@]*@")


def redact(url: str) -> str:
    """The URL without its secrets (a password in the address or as ``?password=``),
    for messages, ``location`` and every page or line that shows a ledger. A URL that
    does not parse has its address's password masked by pattern, and no query kept:
    the message refusing it names it without raising in turn."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return _USERINFO_PASSWORD.sub(r"\1***@", url.partition("?")[0])
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@")
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(key == "password" for key, _ in query):
        masked = [(k, "***" if k == "password" else v) for k, v in query]
        parts = parts._replace(query=urllib.parse.urlencode(masked, safe="*"))
    elif netloc == parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def tables_gone(location: str, message: str) -> LedgerCorrupt:
    """A table of an open ledger is missing: its schema was dropped, its tables deleted.
    Waiting brings nothing back, so it is ``LedgerCorrupt``, not a fault that may clear:
    the call that met it gets this, and a background step stops at it (logged once)
    rather than retrying for as long as the process lives."""
    return LedgerCorrupt(location, f"{message} (a table of the ledger is gone: dropped?)")


def url_options(
    url: str, where: str, own: frozenset[str], query: str
) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """A ledger URL's ``query``: stopline's own options (``own``), each given once and
    with a value, and the rest in their order (libpq's, for PostgreSQL).
    Else ``LedgerUnavailable`` naming the option, before anything is opened: an option
    given twice took its last value, and one given blank its default, silently. A URL
    holding a NUL character is refused too (libpq reads a name up to it: ``test\\0x``
    was the database ``test``). One rule for both backends' URLs."""
    if "\x00" in url:
        raise LedgerUnavailable(where.replace("\x00", "\\0"), "the URL holds a NUL character")
    mine: dict[str, str] = {}
    rest: list[tuple[str, str]] = []
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if key not in own:
            rest.append((key, value))
        elif key in mine:
            raise LedgerUnavailable(where, f"{key} is given twice")
        elif not value:
            raise LedgerUnavailable(where, f"{key} is given without a value")
        else:
            mine[key] = value
    return mine, rest


_SQLITE_OPTIONS = frozenset(
    {"busy_timeout", "synchronous", "group_commit_ms", "cancel_poll_ms", "cache_mib"}
)


async def open_backend(url: str | None = None, *, read_only: bool = False) -> Backend:
    """The backend for ``url``. ``read_only``: open an existing ledger without changing
    anything (no file created, no journal switched, no schema migrated, no write
    transaction); anything that is not a stopline ledger is refused with a typed error."""
    url = resolve_url(url)
    if url.startswith("sqlite:///"):
        from stopline.ledger.sqlite import CACHE_MIB, MAX_CACHE_MIB, SQLiteBackend

        path, _, query = url.removeprefix("sqlite:///").partition("?")
        options, rest = url_options(url, url, _SQLITE_OPTIONS, query)
        if rest:
            raise LedgerUnavailable(url, f"unknown option(s) {sorted(k for k, _ in rest)}")
        mib = options.get("cache_mib", str(CACHE_MIB))
        cache_mib = whole_option(url, "cache_mib", mib, low=1, high=MAX_CACHE_MIB)
        return await SQLiteBackend.open(
            Path(path),
            busy_timeout=seconds_option(url, "busy_timeout", options.get("busy_timeout", "10")),
            synchronous=options.get("synchronous", "FULL").upper(),
            group_commit=milliseconds_option(
                url, "group_commit_ms", options.get("group_commit_ms", "2")
            ),
            cancel_poll=milliseconds_option(
                url, "cancel_poll_ms", options.get("cancel_poll_ms", "50")
            ),
            read_only=read_only,
            cache_mib=cache_mib,
        )
    if url.startswith(("postgresql://", "postgres://")):
        try:
            from stopline.ledger.postgres import PostgresBackend
        except ImportError as exc:
            raise LedgerUnavailable(
                url, "the PostgreSQL ledger needs psycopg: pip install 'stopline[postgres]'"
            ) from exc
        return await PostgresBackend.open(url, read_only=read_only)
    raise LedgerUnavailable(url, "unsupported ledger URL; use sqlite:///PATH or postgresql://...")


def whole_option(url: str, name: str, text: str, *, low: int, high: int | None = None) -> int:
    """A URL option that is a whole number from ``low`` (to ``high``, if given); else
    ``LedgerUnavailable`` naming it as the URL gave it."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        upto = f"-{high}" if high is not None else " or more"
        raise LedgerUnavailable(url, f"{name}={text!r} is not a whole number {low}{upto}")
    return value


def number_option(url: str, name: str, text: str, high: float, unit: str) -> float:
    """A URL option that is a number from 0 to ``high`` (in ``unit``); else
    ``LedgerUnavailable`` naming it. One rule for every backend's numeric options."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= high:  # NaN too
        raise LedgerUnavailable(url, f"{name}={text!r} is not 0-{high:g} {unit}")
    return value


MAX_WAIT_S = 86_400  # the longest wait a ledger option may ask for: a day


def seconds_option(url: str, name: str, text: str) -> float:
    """A URL option that is a wait in seconds (0-86400); else ``LedgerUnavailable`` naming
    it (SQLite's ``busy_timeout``, PostgreSQL's ``retry_for``)."""
    return number_option(url, name, text, MAX_WAIT_S, "seconds")


def milliseconds_option(url: str, name: str, text: str) -> float:
    """A URL option in milliseconds (0-60000), as seconds; else ``LedgerUnavailable``
    naming it (``group_commit_ms`` and the like)."""
    return number_option(url, name, text, 60_000, "milliseconds") / 1000
