"""Odd values through the public API read back, or are refused, alike on both engines.

One rule, one place: whether a result is kept, and how a checkpoint's name and state
are written, is decided before either backend writes (``domain.jsontext``,
``ledger.rows``), so SQLite and PostgreSQL give the same answer to the same value
(ADR 0095). Each engine is a real one: a SQLite file, a schema of its own on the
test server.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from typing import Any

import anyio
import pytest

import stopline
from stopline import InvalidInput, LedgerCorrupt, NotReplayable, OpStatus, Verdict
from stopline.domain import jsontext
from stopline.domain.limits import MAX_ID_CHARS
from tests.conftest import FAST_VERIFY
from tests.rules.test_unreadable_rows import tamper

pytestmark = pytest.mark.timeout(120)

# each test on both engines (``tests/conftest.py`` does so for the rule suites only)
both = pytest.mark.parametrize("ledger_backend", ["sqlite", "postgres"], indirect=True)


def _nested(depth: int) -> list[Any]:
    """A list ``depth`` lists deep (``[]`` is one)."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def _depths() -> list[int]:
    """Past the bound, and near where this stack's ``json`` gave up: there one engine
    kept a value the other dropped without a word, or kept what it could not read."""
    limit = sys.getrecursionlimit()
    return [jsontext.MAX_DEPTH + 1, *range(limit - 120, limit - 10, 10)]


@both
async def test_a_result_nested_too_deeply_is_said_not_kept_on_both_engines(
    ledger: stopline.Ledger,
) -> None:
    """Kept or not hung on the depth of the stack writing it: ~975 levels deep, SQLite
    kept a result that PostgreSQL's group commit dropped with no evidence saying so (a
    replay returned ``None``), and one level shallower PostgreSQL kept it and its read
    raised ``RecursionError`` out of the ledger's block. Past ``MAX_DEPTH`` it is never
    kept, the evidence says why, and a replay raises ``NotReplayable``."""
    depths = _depths()

    @stopline.tool
    async def answer(ctx: stopline.CallContext, depth: int) -> Any:
        return _nested(depth)

    async with ledger.run("job", owner="user:1", run_id="r-deep") as run:
        for depth in depths:
            got = await run.call(answer, depth, key=f"d{depth}")
            assert got is not None  # the caller has its answer
        for depth in depths:
            op = await ledger.backend.get_operation(f"r-deep/d{depth}")
            assert op.status is OpStatus.COMMITTED
            assert (op.has_result, op.result) == (False, None), depth
            assert op.result_not_kept is not None and "nested too deeply" in op.result_not_kept
            with pytest.raises(NotReplayable):
                await run.call(answer, depth, key=f"d{depth}")
    receipt = await ledger.receipt("r-deep")
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED] * len(depths)


@both
async def test_a_result_at_the_bound_is_kept_and_replayed_on_both_engines(
    ledger: stopline.Ledger,
) -> None:
    deep = {"a": _nested(jsontext.MAX_DEPTH - 1)}

    @stopline.tool
    async def answer(ctx: stopline.CallContext) -> Any:
        return deep

    async with ledger.run("job", owner="user:1", run_id="r-bound") as run:
        await run.call(answer, key="k")
        assert await run.call(answer, key="k") == deep  # replayed
    op = await ledger.backend.get_operation("r-bound/k")
    assert op.has_result and op.result == deep and op.result_not_kept is None


READ_BACK: dict[str, Any] = {
    "set": {1, 2},
    "bytes": b"\x00",
    "deep": _nested(jsontext.MAX_DEPTH + 1),
}


@both
@pytest.mark.parametrize("kind", sorted(READ_BACK))
async def test_a_read_back_result_the_ledger_cannot_keep_is_said_not_kept(
    ledger_url: str, kind: str
) -> None:
    """A verifier's ``ReadBack(result=...)`` that is not JSON (or too deep) was dropped
    by the write with nothing saying so: the operation ``committed`` with no result,
    and a replay returned ``None``, a value the provider never gave (R10). It is
    written with ``result_not_replayable`` evidence, as an answer's is."""

    @stopline.tool
    async def send(ctx: stopline.CallContext) -> str:
        raise stopline.NoAnswer(stopline.Cause.TRANSPORT, "the reply was lost")

    @send.verifier
    async def found(ctx: stopline.CallContext) -> stopline.ReadBack:
        return stopline.ReadBack(Verdict.COMMITTED, "outbox", "found", result=READ_BACK[kind])

    async with (
        stopline.open(ledger_url, verify=FAST_VERIFY) as ledger,
        ledger.run("job", owner="user:1", run_id="r-read") as run,
    ):
        with pytest.raises(stopline.NoAnswer):
            await run.call(send, key="k")
        with anyio.fail_after(30):
            while (op := await ledger.backend.get_operation("r-read/k")).status not in (
                OpStatus.COMMITTED,
                OpStatus.NEEDS_REVIEW,
            ):
                await ledger.wait_for_change("r-read", poll=0.05)
        assert op.status is OpStatus.COMMITTED and op.result is None
        assert op.result_not_kept is not None
        with pytest.raises(NotReplayable):
            await run.call(send, key="k")


ODD_RESULTS: list[Any] = [
    "nul \x00 inside",
    {"k\x00": ["\x00"]},
    "lone \ud800 surrogate",
    {"\udc80": "\udfff"},
    "c1 \x9b and bidi \u202e",
    2**63 + 1,
    2**64 + 1,
    -(2**70),
    [math.inf, -math.inf],
    {"1": "str key"},
    "x" * 100_000,
    _nested(jsontext.MAX_DEPTH),
]


@both
async def test_odd_results_read_back_the_same_on_both_engines(ledger: stopline.Ledger) -> None:
    """NUL and lone surrogates (which PostgreSQL's ``text`` and UTF-8 refuse), integers
    past 64 bits, infinities: a result is JSON text with every such character escaped,
    so each engine keeps it as it came, one at a time and in a group commit's batch."""

    def tool_for(i: int) -> stopline.Tool[Any]:
        async def answer(ctx: stopline.CallContext) -> Any:
            return ODD_RESULTS[i]

        return stopline.Tool(answer, name=f"odd{i}")

    tools = [tool_for(i) for i in range(len(ODD_RESULTS))]
    async with ledger.run("job", owner="user:1", run_id="r-odd") as run:
        await run.call(tools[0], key="alone")
        async with anyio.create_task_group() as tg:  # together: one batch, as it can
            for i, t in enumerate(tools):
                tg.start_soon(functools.partial(run.call, t, key=f"k{i}"))
        for i, value in enumerate(ODD_RESULTS):
            op = await ledger.backend.get_operation(f"r-odd/k{i}")
            assert op.status is OpStatus.COMMITTED and op.has_result, i
            assert op.result == value, i
            assert await run.call(tools[i], key=f"k{i}") == value  # replayed as it came
    assert (await ledger.backend.get_operation("r-odd/alone")).result == ODD_RESULTS[0]


@both
async def test_nan_and_int_keys_read_back_as_json_has_them_on_both_engines(
    ledger: stopline.Ledger,
) -> None:
    """A NaN is kept (SQLite and PostgreSQL hold the text, no ``jsonb`` refuses it); an
    integer key reads back as JSON writes it, a string."""

    @stopline.tool
    async def answer(ctx: stopline.CallContext, value: Any) -> Any:
        return value

    async with ledger.run("job", owner="user:1", run_id="r-nan") as run:
        await run.call(answer, {"nan": math.nan}, key="nan")
        await run.call(answer, {7: "int key"}, key="int")
    nan = await ledger.backend.get_operation("r-nan/nan")
    assert math.isnan(nan.result["nan"])
    assert (await ledger.backend.get_operation("r-nan/int")).result == {"7": "int key"}


BAD_NAMES = {
    "nul": "a\x00b",
    "surrogate": "a\ud800b",
    "long": "x" * (MAX_ID_CHARS + 1),
    "control": "a\x1bb",
}


@both
@pytest.mark.parametrize("bad", sorted(BAD_NAMES))
async def test_a_checkpoint_name_that_cannot_be_stored_is_refused_alike(
    ledger: stopline.Ledger, bad: str
) -> None:
    """A NUL in a checkpoint's name was stored by SQLite and refused by PostgreSQL
    (``LedgerRefused``), a lone surrogate raised ``UnicodeEncodeError`` on both, a
    10 MB name was stored: ``InvalidInput`` naming it, nothing written, on both."""
    async with ledger.run("job", owner="user:1", run_id="r-cp") as run:
        with pytest.raises(InvalidInput) as refused:
            await run.checkpoint(BAD_NAMES[bad], {"step": 1})
        assert refused.value.what == "name"
        assert await ledger.backend.last_checkpoint("r-cp") is None
        edge = "n" * MAX_ID_CHARS  # at the limit: taken
        await run.checkpoint(edge, {"step": 1})
    checkpoint = await ledger.backend.last_checkpoint("r-cp")
    assert checkpoint is not None and checkpoint.name == edge


BAD_STATES: dict[str, Any] = {
    "set": {1, 2},
    "bytes": b"state",
    "tuple-key": {(1, 2): "a"},
    "deep": _nested(jsontext.MAX_DEPTH + 1),
    "too-deep-for-json": _nested(50_000),
}


@both
@pytest.mark.parametrize("bad", sorted(BAD_STATES))
async def test_a_checkpoint_state_that_is_not_json_is_refused_alike(
    ledger: stopline.Ledger, bad: str
) -> None:
    """A bare ``TypeError`` (or ``RecursionError``) from inside the checkpoint's
    transaction: ``InvalidInput`` naming the state, before anything is written."""
    async with ledger.run("job", owner="user:1", run_id="r-st") as run:
        with pytest.raises(InvalidInput) as refused:
            await run.checkpoint("c", BAD_STATES[bad])
        assert refused.value.what == "state"
        assert await ledger.backend.last_checkpoint("r-st") is None
        odd = {"nul": "\x00", "nan": math.inf, "big": 2**70}  # JSON, if odd: kept
        await run.checkpoint("c", odd)
    checkpoint = await ledger.backend.last_checkpoint("r-st")
    assert checkpoint is not None and checkpoint.state == odd


@both
async def test_a_stored_result_deeper_than_a_read_can_go_is_ledger_corrupt(
    ledger_url: str,
) -> None:
    """One written before the bound, nested past what the reading stack can decode:
    the read raised a bare ``RecursionError`` (out of a receipt, the CLI, the
    console); it is ``LedgerCorrupt`` naming the row."""

    @stopline.tool
    async def answer(ctx: stopline.CallContext) -> str:
        return "sent"

    async with stopline.open(ledger_url) as ledger:
        async with ledger.run("job", owner="user:1", run_id="r-old") as run:
            await run.call(answer, key="k")
        depth = sys.getrecursionlimit() * 5
        deep = "[" * depth + "]" * depth
        tamper(ledger_url, "UPDATE operations SET result = ?", deep)
        with pytest.raises(LedgerCorrupt) as corrupt:
            await ledger.backend.get_operation("r-old/k")
        assert "r-old/k" in str(corrupt.value)


def test_depth_is_read_from_the_structure_not_from_brackets_in_strings() -> None:
    bound = jsontext.MAX_DEPTH
    at, past = _nested(bound), _nested(bound + 1)
    assert not jsontext.depth_over(json.dumps(at)) and jsontext.depth_over(json.dumps(past))
    for noise in ("[" * 1000, "]" * 1000, '\\"]]' * 300, "\\" * 7 + "[" * 500):
        assert not jsontext.depth_over(json.dumps([noise, _nested(bound - 1), noise]))
        assert jsontext.depth_over(json.dumps({noise: [noise, past]}))
    for encode in (jsontext.compact, jsontext.canonical, jsontext.canonical_or_repr):
        assert encode(at) == json.dumps(at, separators=(",", ":"))
        with pytest.raises(RecursionError):
            encode(past)
