"""R8, R13, R14 and issue 20 against a server that knows nothing of stopline: the
truth matrix (tests/support/truth_matrix.py), printed. Its third verifier column
is the same server kept through stopline's server-side helpers, read back by
its ``stopline_verify``.

CI runs a representative subset (every tool mode x every cancel point on one
transport, every policy and verifier at one point, a diagonal over the other
transports and eras, the stopline read-back at two points); ``STOPLINE_TRUTH_MATRIX=full``
runs the whole cross-product (4 transports x 4 modes x 6 points x 3 policies x
3 verifiers):

    STOPLINE_TRUTH_MATRIX=full pytest tests/mcp/test_truth_matrix.py -s
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import stopline
from mcp import Client
from stopline.integrations.mcp import StoplineMCP
from tests.conftest import FAST_VERIFY
from tests.support.thirdparty_mcp_server import http_server, stdio_params
from tests.support.truth_matrix import (
    Cell,
    Row,
    baseline_cells,
    full,
    policies,
    render,
    run_bare,
    run_cell,
    subset,
    totals,
    verifier_for,
)

FULL = os.environ.get("STOPLINE_TRUTH_MATRIX") == "full"
pytestmark = pytest.mark.timeout(3600 if FULL else 300)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("truth") / "truth.jsonl"


@pytest.fixture(scope="module")
def http_url(log: Path) -> Iterator[str]:
    with http_server(log) as url:
        yield url


@pytest.fixture(scope="module")
def stopline_http_url(log: Path) -> Iterator[str]:
    """The same server kept through stopline's server-side helpers (stopline_verify)."""
    with http_server(log, "--stopline-effects", str(log.with_name("effects-http.db"))) as url:
        yield url


def target(transport: str, log: Path, http_url: str) -> tuple[object, str]:
    kind, era = transport.split("-")
    mode = "legacy" if era == "legacy" else "2026-07-28"
    return (stdio_params(log) if kind == "stdio" else http_url), mode


def stopline_target(transport: str, log: Path, http_url: str) -> tuple[object, str]:
    """``target`` for the stopline read-back column: one effects record per server process."""
    where, mode = target(transport, log, http_url)
    if transport.startswith("stdio"):
        where = stdio_params(log, "--stopline-effects", str(log.with_name(f"fx-{transport}.db")))
    return where, mode


async def test_r13_r14_truth_matrix_against_a_third_party_server(
    tmp_path: Path, log: Path, http_url: str, stopline_http_url: str
) -> None:
    cells = full() if FULL else subset()
    bare = baseline_cells(cells)
    rows: list[Row] = []
    bare_rows: list[Row] = []
    async with contextlib.AsyncExitStack() as stack:
        ledger = await stack.enter_async_context(
            stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY)
        )
        conns: dict[str, StoplineMCP] = {}
        for transport, verifier in sorted({(c.transport, c.verifier) for c in cells}):
            if verifier == "stopline_verify":
                where, mode = stopline_target(transport, log, stopline_http_url)
            else:
                where, mode = target(transport, log, http_url)
            # one name per connection: the ledger knows a tool (and its verifier) by name
            name = f"tp-{transport}-{verifier}"
            conn = StoplineMCP(where, mode=mode, name=name, policies=policies())  # type: ignore[arg-type]
            if verifier == "read_tool":
                conn.verifiers = {m: verifier_for(conn) for m in policies()}
            conns[f"{transport}/{verifier}"] = await stack.enter_async_context(conn)
        clients: dict[str, Client] = {}
        for transport in sorted({c.transport for c in bare}):
            where, mode = target(transport, log, http_url)
            clients[transport] = await stack.enter_async_context(Client(where, mode=mode))  # type: ignore[arg-type]
        limiter = anyio.CapacityLimiter(12)

        async def one(cell: Cell, n: int) -> None:
            async with limiter:
                rows.append(await run_cell(ledger, conns, log, cell, n))

        async def one_bare(cell: Cell, n: int) -> None:
            async with limiter:
                bare_rows.append(await run_bare(clients[cell.transport], log, cell, n))

        async with anyio.create_task_group() as tg:
            for n, cell in enumerate(cells):
                tg.start_soon(one, cell, n)
            for n, cell in enumerate(bare):
                tg.start_soon(one_bare, cell, n)
    rows.sort(key=lambda r: r.cell.name)
    bare_rows.sort(key=lambda r: r.cell.name)
    default = [r for r in rows if r.cell.policy is stopline.Policy.VERIFY]
    immediate = [r for r in rows if r.cell.policy is stopline.Policy.IMMEDIATE]
    summary = {
        "bare mcp SDK client, cancelling its call": bare_rows,
        "stopline, default verify policy": default,
        "stopline, immediate policy": immediate,
        "stopline, every policy": rows,
    }
    print("\n" + render([*rows, *bare_rows], summary))
    prevented, false_claims, duplicates = totals(rows)
    assert false_claims == 0, [r.cell.name for r in rows if r.verdict == "FALSE"]
    assert duplicates == 0, [r.cell.name for r in rows if r.duplicates]
    # cells end definite whenever a read tool exists
    definite = [r for r in rows if r.cell.verifier != "none"]
    assert [r.cell.name for r in definite if r.verdict != "ok"] == []
    # issue 20: the default policy prevents at least what the bare SDK client prevents
    covered = {(r.cell.transport, r.cell.mode, r.cell.point) for r in default}
    bare_same = [r for r in bare_rows if (r.cell.transport, r.cell.mode, r.cell.point) in covered]
    assert totals(default)[0] >= totals(bare_same)[0]
    assert prevented > 0
