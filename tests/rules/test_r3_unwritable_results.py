"""R3/R5: an answer proves its call happened, whatever it holds.

A tool that returned a value nested past Python's recursion limit, or an integer past
its digits limit (``sys.set_int_max_str_digits``), had answered: its effect happened,
and its caller got the value. The ledger could not digest the value, and recorded the
call ``unknown`` ("may have happened; verifying ... next: human review"); a read-back
that proved the effect with such a value failed in the background, never retried. The
value is digested by its type, not kept (a replay cannot return it), and the call is
``committed``, as for any result the ledger does not keep.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import stopline
from stopline import OpStatus, Verdict
from stopline.domain.model import NOT_REPLAYABLE

pytestmark = pytest.mark.timeout(60)


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


VALUES: dict[str, Callable[[], Any]] = {"nested": lambda: _nested(5000), "digits": lambda: 10**5000}


@pytest.mark.parametrize("kind", sorted(VALUES))
async def test_an_answer_that_cannot_be_written_out_is_committed_not_kept(
    ledger: stopline.Ledger, kind: str
) -> None:
    @stopline.tool
    async def answer(ctx: stopline.CallContext) -> Any:
        return VALUES[kind]()

    async with ledger.run("job", owner="user:1", run_id="r") as run:
        got = await run.call(answer, key="k")
    op = await ledger.backend.get_operation("r/k")
    receipt = await ledger.receipt("r")
    assert got is not None  # the caller has its answer
    assert op.status is OpStatus.COMMITTED
    said = {e.ref: e.detail for e in op.evidence}
    assert "cannot be written out" in said[NOT_REPLAYABLE]
    assert op.result_not_kept is not None and op.result is None
    assert "verifying" not in receipt.text() and "review" not in receipt.text()


async def test_a_read_back_that_proves_it_with_such_a_value_records_committed(
    ledger: stopline.Ledger,
) -> None:
    @stopline.tool
    async def send(ctx: stopline.CallContext) -> str:
        raise stopline.NoAnswer(stopline.Cause.TRANSPORT, "the reply was lost")

    @send.verifier
    async def found(ctx: stopline.CallContext) -> stopline.ReadBack:
        return stopline.ReadBack(Verdict.COMMITTED, "outbox", "found", result=_nested(5000))

    async with ledger.run("job", owner="user:1", run_id="r") as run:
        with pytest.raises(stopline.NoAnswer):
            await run.call(send, key="k")
    receipt = await ledger.wait_settled("r", timeout=10)
    op = await ledger.backend.get_operation("r/k")
    assert op.status is OpStatus.COMMITTED and op.result is None
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]


@pytest.mark.parametrize("verdict", [Verdict.COMMITTED, Verdict.NOT_COMMITTED])
async def test_a_late_answer_holding_such_a_value_is_kept_as_evidence(
    ledger: stopline.Ledger, verdict: Verdict
) -> None:
    @stopline.tool
    async def send(ctx: stopline.CallContext) -> str:
        raise stopline.NoAnswer(stopline.Cause.TIMEOUT, "no answer in time")

    async with ledger.run("job", owner="user:1", run_id="r") as run:
        with pytest.raises(stopline.NoAnswer):
            await run.call(send, key="k")
    op = await ledger.late_response("r/k", verdict, result=10**5000, ref="psp:late")
    assert op.status is (
        OpStatus.COMMITTED if verdict is Verdict.COMMITTED else OpStatus.NOT_COMMITTED
    )
    assert "psp:late" in {e.ref for e in op.evidence}
