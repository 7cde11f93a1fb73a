"""The pytest plugin: a ``stopline_explore`` fixture that fails a test with the matrix.

Installed with stopline (entry point ``pytest11``)::

    async def test_cancellation(stopline_explore):
        await stopline_explore(my_workflow, make_providers)

Each cell's ledger is kept under the test's ``tmp_path`` for inspection: the
first call's as ``explore-1-<run id>.db``, the next call's ``explore-2-...``
(calls at once in one test never share a file). A passing exploration that took
a tool's effects on the ledger's word warns (``UserWarning``) naming the tool. A
call never awaited fails the test: it explored nothing.
"""

from __future__ import annotations

import inspect
import itertools
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from stopline.testing.explorer import explore
from stopline.testing.matrix import Matrix

__all__ = ["stopline_explore"]

Explore = Callable[..., Awaitable[Matrix]]


@pytest.fixture
def stopline_explore(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Explore]:
    """``await stopline_explore(workflow, providers, **explore_options)``: the matrix,
    or a test failure whose message is its report (with each failing cell's id).

    Asked for by a test that is not async, it fails the test at once: called there,
    nothing awaits it, nothing is explored, and the test passed. A call the test
    never awaited (a forgotten ``await``) fails it too, once it is over."""
    if not inspect.iscoroutinefunction(getattr(request, "function", None)):
        pytest.fail(
            f"{request.node.name}: stopline_explore is awaited, so the test must be async "
            "(`async def`, run by anyio's pytest plugin: @pytest.mark.anyio)",
            pytrace=False,
        )
    calls = itertools.count(1)
    made: list[Coroutine[Any, Any, Matrix]] = []

    def call(workflow: Any, providers: Any, **options: Any) -> Awaitable[Matrix]:
        made.append(run(workflow, providers, **options))
        return made[-1]

    async def run(workflow: Any, providers: Any, **options: Any) -> Matrix:
        if "ledger_url" not in options and "?" in str(tmp_path):
            # a sqlite:/// URL's options start at "?": its ledgers went outside tmp_path
            pytest.fail(
                f"{request.node.name}: the test's tmp_path ({tmp_path}) holds '?', which a "
                "sqlite:/// ledger URL cannot carry: give another --basetemp, or "
                "stopline_explore(..., ledger_url='sqlite:///DIR/NAME.db')",
                pytrace=False,
            )
        options.setdefault("ledger_url", f"sqlite:///{tmp_path / f'explore-{next(calls)}.db'}")
        options.setdefault("out", None)
        matrix = await explore(workflow, providers, **options)
        if not matrix.ok:
            pytest.fail(matrix.report(), pytrace=False)
        if matrix.unverified:  # a passing test's report is never shown: say it here
            warnings.warn(matrix.unverified_note(), UserWarning, stacklevel=2)
        return matrix

    yield call
    unawaited = [c for c in made if inspect.getcoroutinestate(c) == inspect.CORO_CREATED]
    for coroutine in unawaited:
        coroutine.close()  # no "never awaited" warning on top of the failure
    if unawaited:
        pytest.fail(
            f"{request.node.name}: stopline_explore(...) was called and never awaited: "
            "nothing was explored (write `await stopline_explore(...)`)",
            pytrace=False,
        )
