"""The ledger schema on PostgreSQL: the same ordered migrations as SQLite, translated.

``schema.MIGRATIONS`` is the one source. Its DDL is written for SQLite; the
few spellings that differ are translated here (an identity column for the
log's sequence, double precision for times), so a migration added there
reaches both backends. The version lives in a one-row table,
``stopline_schema``; a version above ``SCHEMA_VERSION`` is refused with
``SchemaTooNew`` before anything is written. Migrating takes a transaction-
scoped advisory lock, so workers starting together migrate once.
"""

from __future__ import annotations

import re

from stopline.errors import LedgerUnavailable, SchemaTooNew
from stopline.ledger.postgres_txn import Tx
from stopline.ledger.schema import (
    MIGRATIONS,
    SCHEMA_VERSION,
    SqliteOnly,
    check_readable,
    refuse_foreign,
)

__all__ = ["check", "migrate", "translate"]

_SPELLINGS = (
    (
        re.compile(r"INTEGER PRIMARY KEY AUTOINCREMENT"),
        "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
    ),
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
    (re.compile(r"\bINDEXED BY \w+"), ""),
)


def translate(ddl: str) -> list[str]:
    """SQLite DDL of one migration as PostgreSQL statements (none for SQLite's own)."""
    if isinstance(ddl, SqliteOnly):
        return []
    statements = []
    for statement in ddl.split(";"):
        if statement.strip():
            for pattern, spelling in _SPELLINGS:
                statement = pattern.sub(spelling, statement)
            statements.append(statement.strip())
    return statements


async def migrate(tx: Tx, schema: str | None) -> str:
    """Create the schema if asked, then bring the tables to ``SCHEMA_VERSION``; the
    ledger's notification channel."""
    async with tx.transaction():
        await tx.run("SELECT pg_advisory_xact_lock(hashtext(?))", (f"stopline:{schema or ''}",))
        if schema:
            await tx.run(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            await tx.run(f'SET LOCAL search_path = "{schema}"')
        version = await _version(tx)
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(tx.location, version, SCHEMA_VERSION)
        for step in MIGRATIONS[version:]:
            for statement in translate(step):
                await tx.run(statement)
        if version != SCHEMA_VERSION:
            await tx.run("UPDATE stopline_schema SET version = ?", (SCHEMA_VERSION,))
        return await _channel(tx)


async def check(tx: Tx, schema: str | None) -> None:
    """Read-only: refuse anything but a stopline ledger at ``SCHEMA_VERSION``; write
    nothing. Its notification channel is not read: a reader neither cancels nor
    listens, and a role that must not interrupt calls may not read it (ADR 0041)."""
    if schema:
        found = await tx.one("SELECT count(*) FROM pg_namespace WHERE nspname = ?", (schema,))
        if not found[0]:
            raise LedgerUnavailable(tx.location, f"no schema {schema!r}: not a stopline ledger")
        await tx.run(f'SET search_path = "{schema}"')
    tables = await tx.one(
        "SELECT count(*) FROM information_schema.tables WHERE table_schema = current_schema()"
    )
    version = 0
    if (await tx.one("SELECT to_regclass('stopline_schema') IS NOT NULL"))[0]:
        row = await tx.one("SELECT version FROM stopline_schema")
        version = int(row[0]) if row is not None else 0
    check_readable(tx.location, version, tables[0])


async def _channel(tx: Tx) -> str:
    """The channel the ledger's cancels are notified on (schema V5: a random name)."""
    return str((await tx.one("SELECT name FROM notify_channel"))[0])


async def _version(tx: Tx) -> int:
    row = await tx.one("SELECT to_regclass('stopline_schema') IS NOT NULL")
    if row[0]:
        found = await tx.one("SELECT version FROM stopline_schema")
        return int(found[0]) if found is not None else 0
    tables = await tx.one(
        "SELECT count(*) FROM information_schema.tables WHERE table_schema = current_schema()"
    )
    refuse_foreign(tx.location, 0, tables[0])
    await tx.run(
        "CREATE TABLE stopline_schema (one BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (one),"
        " version INTEGER NOT NULL)"
    )
    await tx.run("INSERT INTO stopline_schema (version) VALUES (0)")
    return 0
