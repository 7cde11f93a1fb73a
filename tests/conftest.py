"""Shared fixtures: a real SQLite ledger file per test, on asyncio (and, for modules
marked ``uvloop_too``, on uvloop's loop as well)."""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop

import stopline
from stopline import VerifyBudget

FAST_VERIFY = VerifyBudget(attempts=4, first_delay=0.01, factor=2.0, max_delay=0.05)

# anyio's backend for uvloop's loop: many applications' servers run on it (uvicorn's
# default where it is installed), and it is a loop we did not write
UVLOOP = ("asyncio", {"use_uvloop": True})


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio; modules that prove trio too override this."""
    return "asyncio"


# Suites whose storage-touching tests run on both backends (STOPLINE_TEST_BACKENDS
# narrows it, e.g. "sqlite" on a machine without PostgreSQL).
_BOTH_BACKENDS = ("scenarios", "rules", "lifecycle")


def _on_uvloop(*values: Any) -> Any:
    """A parameter set on uvloop. pytest-timeout's alarm raises in a signal handler,
    which uvloop's loop logs and swallows, so its timeout watches from a thread."""
    return pytest.param(*values, marks=pytest.mark.timeout(method="thread"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Storage-touching tests run on SQLite and PostgreSQL; modules marked ``trio_too``
    also on trio, with SQLite (psycopg's async driver is asyncio-only, so that
    combination is never generated rather than skipped); modules marked ``uvloop_too``
    also on uvloop's loop (with each engine, or on their own where no engine is)."""
    uvloop_too = metafunc.definition.get_closest_marker("uvloop_too") is not None and not any(
        "anyio_backend" in str(mark.args[0])
        for mark in metafunc.definition.iter_markers("parametrize")
    )  # a test naming its own loops keeps them
    if "ledger_backend" not in metafunc.fixturenames:
        if uvloop_too and "anyio_backend" in metafunc.fixturenames:
            metafunc.parametrize(
                "anyio_backend", ["asyncio", _on_uvloop(UVLOOP)], ids=["asyncio", "uvloop"]
            )
        return
    suite = metafunc.definition.path.parent.name
    wanted = os.environ.get("STOPLINE_TEST_BACKENDS", "sqlite,postgres").split(",")
    backends = [b for b in ("sqlite", "postgres") if b in wanted] if suite in _BOTH_BACKENDS else []
    if not backends:
        return
    combos: list[Any] = [("asyncio", b) for b in backends]
    ids = [f"asyncio-{b}" for b in backends]
    if metafunc.definition.get_closest_marker("trio_too") and "sqlite" in backends:
        combos.append(("trio", "sqlite"))
        ids.append("trio-sqlite")
    if uvloop_too:
        combos += [_on_uvloop(UVLOOP, b) for b in backends]
        ids += [f"uvloop-{b}" for b in backends]
    metafunc.parametrize(
        ("anyio_backend", "ledger_backend"), combos, indirect=["ledger_backend"], ids=ids
    )


@pytest.fixture
def ledger_backend(request: pytest.FixtureRequest) -> str:
    return str(getattr(request, "param", "sqlite"))


@pytest.fixture
def ledger_url(tmp_path: Path, ledger_backend: str) -> Iterator[str]:
    if ledger_backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    from tests.postgres.server import fresh_schema

    yield from fresh_schema()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh schema on the test server (``tests/postgres/server.py``), dropped after."""
    from tests.postgres.server import fresh_schema

    yield from fresh_schema()


@pytest.fixture
async def ledger(ledger_url: str) -> AsyncIterator[stopline.Ledger]:
    async with stopline.open(ledger_url, verify=FAST_VERIFY) as opened:
        yield opened


@pytest.fixture
async def _as_an_application(anyio_backend: Any) -> AsyncIterator[None]:
    """An async test runs as an application's own ``asyncio.run`` would: anyio's runner
    tells sniffio the loop (a context variable), and an application's loop does not.
    Inside a task sniffio tells asyncio anyway; in a plain callback of the loop it
    cannot, and anyio then cannot start a task or make a scope there. Under the
    runner's word a callback that needs it passed every test and failed in
    applications (ADR 0042, addendum).

    A test on uvloop is checked to run on uvloop's loop: anyio's runner is shared by
    the tests holding it, so a test could otherwise run on the loop of another."""
    import sniffio

    if anyio_backend == UVLOOP:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    elif anyio_backend == "asyncio":
        assert not isinstance(asyncio.get_running_loop(), uvloop.Loop)
    else:
        yield
        return
    told = sniffio.current_async_library_cvar.set(None)
    try:
        yield
    finally:
        sniffio.current_async_library_cvar.reset(told)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # async tests only: a sync one runs its own loop, if any
        if inspect.iscoroutinefunction(getattr(item, "obj", None)):
            item.fixturenames.append("_as_an_application")  # type: ignore[attr-defined]
