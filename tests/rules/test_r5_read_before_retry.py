"""R5 across a retry: a read-back begun before an operation was sent again speaks of the
earlier attempt only (ADR 0099).

An operation in doubt is read back in the background as soon as its answer is lost.
A repeat of the call under the same key reads it back too, and sends it again once
that read proves it did not happen. The background read, begun before the retry and
written after it, was recorded against the operation as it was then: its "not
committed" contradicted the retry's commit (``needs_review``, a commit put before a
reviewer: CI saw it under load), or, were the retry in doubt in its turn, made that
retry ``not_committed`` (a lie: its effect may have happened, and a third call would
be sent). Now a read-back's verdict names the attempt it looked for, and the ledger
moves the operation with it only while no later attempt has been sent; otherwise it
is kept as evidence (``read_before_retry``) and the later attempt is read back on its
own budget.

Real ledgers (SQLite files and PostgreSQL); the background read is held at a barrier
after it has looked, so the retry passes while it is out; nothing is timed.
"""

from __future__ import annotations

import anyio
import pytest

import stopline
from stopline import OpStatus, ReadBack, Verdict
from stopline.domain.vocab import NoteKind

pytestmark = pytest.mark.timeout(30)


class Refunds:
    """A refund whose first call hangs up before it happens; the second happens, then
    (``second_lost``) hangs up too. The read-back says what ``done`` holds when it
    looks; the first read-back (the background one) is held once it has looked."""

    def __init__(self, *, second_lost: bool) -> None:
        self.second_lost = second_lost
        self.calls = 0
        self.done: list[str] = []
        self.reads: list[Verdict] = []
        self.looked = anyio.Event()
        self.release = anyio.Event()
        self.tool = stopline.tool(self.refund)
        self.tool.verifier(self.read_back)

    async def refund(self, order: str) -> str:
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("the payments API hung up before it refunded")
        self.done.append(order)
        if self.second_lost:
            raise ConnectionError("the payments API hung up after it refunded")
        return f"refunded {order}"

    async def read_back(self, ctx: stopline.CallContext) -> ReadBack:
        verdict = Verdict.COMMITTED if self.done else Verdict.NOT_COMMITTED
        self.reads.append(verdict)
        if len(self.reads) == 1:
            self.looked.set()
            await self.release.wait()
        return ReadBack(verdict, "refunds", "read")


async def _retried_while_read(ledger: stopline.Ledger, refunds: Refunds) -> str:
    """Call, lose the answer, let the background read-back look; call again (the retry
    reads back, finds nothing, sends again); then let the first read-back write."""
    async with ledger.run("refund", owner="user:1") as run:
        with pytest.raises(ConnectionError):
            await run.call(refunds.tool, "1042", key="refund-1042")
        await refunds.looked.wait()  # the background read has looked: nothing yet
        if refunds.second_lost:
            with pytest.raises(ConnectionError):
                await run.call(refunds.tool, "1042", key="refund-1042")
        else:
            assert await run.call(refunds.tool, "1042", key="refund-1042") == "refunded 1042"
        refunds.release.set()  # its "not committed" is written now, after the retry
        await ledger.wait_idle()
    return f"{run.id}/refund-1042"


async def test_a_read_back_begun_before_a_retry_leaves_the_retrys_commit(
    ledger: stopline.Ledger,
) -> None:
    refunds = Refunds(second_lost=False)
    op_id = await _retried_while_read(ledger, refunds)
    op = await ledger.backend.get_operation(op_id)
    assert refunds.done == ["1042"]
    assert (op.status, op.attempts) == (OpStatus.COMMITTED, 2)
    events = await ledger.reads.events(op.run_id)
    kept = [e for e in events if e.kind == NoteKind.READ_BEFORE_RETRY]
    assert len(kept) == 1 and kept[0].data["attempt"] == 1
    assert kept[0].data["verdict"] == "verified_not_committed"
    assert not [e for e in events if e.kind == "conflict"]
    receipt = await ledger.receipt(op.run_id)
    assert receipt.headline is stopline.Headline.COMPLETED


async def test_a_read_back_begun_before_a_retry_never_settles_the_retry_in_doubt(
    ledger: stopline.Ledger,
) -> None:
    """The retry happened, then lost its answer: ``unknown``. The first attempt's "not
    committed" is not the retry's: it is read back on its own and found committed."""
    refunds = Refunds(second_lost=True)
    op_id = await _retried_while_read(ledger, refunds)
    op = await ledger.backend.get_operation(op_id)
    assert refunds.done == ["1042"]
    assert (op.status, op.attempts) == (OpStatus.COMMITTED, 2)
    assert refunds.reads[-1] is Verdict.COMMITTED  # the retry's own read-back
    statuses = [e.to_state for e in await ledger.reads.events(op.run_id) if e.op_id == op_id]
    assert OpStatus.NOT_COMMITTED.value not in statuses[statuses.index("requested", 1) :]
