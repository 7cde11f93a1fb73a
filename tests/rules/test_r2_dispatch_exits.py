"""R2 at every exit of a dispatch: whatever leaves a tool (any exception, any
BaseException, a result that cannot be digested or stored, a write the ledger
refused once), the operation gets an outcome and the run settles."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, cast

import anyio
import anyio.lowlevel
import pytest

import stopline
from stopline import Cause, LedgerFull, NotReplayable, OpStatus
from stopline.domain.limits import MAX_RESULT_CHARS
from stopline.domain.model import OperationSpec
from stopline.ledger.backend import Backend, GateResult, OutcomeUpdate
from stopline.ledger.forwarding import ForwardingBackend
from tests.conftest import FAST_VERIFY

pytestmark = pytest.mark.timeout(30)


class FrameworkStop(BaseException):
    """A framework's control-flow exception (not a cancellation)."""


def raising(exc: BaseException) -> stopline.Tool[Any]:
    async def act(ctx: stopline.CallContext) -> None:
        raise exc

    return stopline.Tool(act, name="act")


@pytest.mark.parametrize(
    "exc", [FrameworkStop("stop"), SystemExit(3), GeneratorExit()], ids=lambda e: type(e).__name__
)
async def test_r2_a_base_exception_leaves_an_outcome_and_the_run_settles(
    ledger: stopline.Ledger, exc: BaseException
) -> None:
    with pytest.raises(type(exc)):
        async with ledger.run("job", owner="user:1", run_id="run-base") as run:
            await run.call(raising(exc), key="k")
    op = await ledger.backend.get_operation("run-base/k")
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
    assert op.cause is Cause.LOCAL_ERROR and type(exc).__name__ in op.evidence[1].detail
    receipt = await ledger.wait_settled("run-base", timeout=10)
    assert receipt.settled


async def test_r2_a_result_that_cannot_be_digested_is_committed_not_kept(
    ledger: stopline.Ledger,
) -> None:
    """The answer came: the call happened, whatever it holds (it was recorded
    ``unknown``, then review, though its caller had the answer: ADR 0049 amended)."""
    loop: list[Any] = []
    loop.append(loop)  # refers to itself: no digest, no JSON

    async def send(ctx: stopline.CallContext) -> list[Any]:
        return loop

    async with ledger.run("job", owner="user:1", run_id="run-loop") as run:
        assert await run.call(stopline.Tool(send), key="k") is loop
    op = await ledger.backend.get_operation("run-loop/k")
    assert op.status is OpStatus.COMMITTED and op.result is None
    assert "cannot be written out" in (op.result_not_kept or "")
    assert (await ledger.wait_settled("run-loop", timeout=10)).settled


async def test_r2_a_result_that_is_not_json_is_refused_at_record_time(
    ledger: stopline.Ledger,
) -> None:
    sent: list[str] = []

    @dataclasses.dataclass
    class Payment:
        amount: int

    async def pay(ctx: stopline.CallContext) -> Payment:
        sent.append(ctx.key)
        return Payment(3)

    tool = stopline.Tool(pay)
    async with ledger.run("job", owner="user:1", run_id="run-obj") as run:
        assert await run.call(tool, key="k") == Payment(3)
    op = await ledger.backend.get_operation("run-obj/k")
    assert op.status is OpStatus.COMMITTED and not op.has_result
    assert op.evidence[-1].ref == "result_not_replayable"
    with pytest.raises(NotReplayable):  # a replay says so; it never hands back None
        await ledger.dispatch("run-obj", tool, key="k")
    assert sent == ["run-obj/k"]


async def test_r2_a_result_longer_than_the_ledger_keeps_is_committed_without_it(
    ledger: stopline.Ledger,
) -> None:
    """A result past ``MAX_RESULT_CHARS`` was written with the outcome: past what the
    engine takes (1e9 bytes on SQLite), the write failed every retry and the call that
    answered stayed ``requested``. Its outcome is recorded without it; a replay says so;
    another run's calls go on."""
    sent: list[str] = []

    async def fetch(ctx: stopline.CallContext, size: int) -> str:
        sent.append(ctx.key)
        return "x" * size

    tool = stopline.Tool(fetch)
    async with ledger.run("job", owner="user:1", run_id="run-long") as run:
        answer: str = await run.call(tool, MAX_RESULT_CHARS, key="k")
        assert answer == "x" * MAX_RESULT_CHARS  # the caller has it; the ledger does not
        assert await run.call(tool, 3, key="short") == "xxx"
    op = await ledger.backend.get_operation("run-long/k")
    assert op.status is OpStatus.COMMITTED and not op.has_result and op.result is None
    assert op.evidence[-1].ref == "result_not_replayable"
    assert f"at most {MAX_RESULT_CHARS:,}" in op.evidence[-1].detail
    with pytest.raises(NotReplayable):
        await ledger.dispatch("run-long", tool, MAX_RESULT_CHARS, key="k")
    assert await ledger.dispatch("run-long", tool, 3, key="short") == "xxx"  # kept, replayed
    assert sent == ["run-long/k", "run-long/short"]
    receipt = await ledger.wait_settled("run-long", timeout=10)
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED] * 2


async def test_r4_a_late_result_longer_than_the_ledger_keeps_is_recorded_without_it(
    ledger: stopline.Ledger,
) -> None:
    """Every path that keeps a result goes through one limit: a late answer's too."""

    async def lose(ctx: stopline.CallContext) -> None:
        raise stopline.NoAnswer(Cause.TIMEOUT, "no answer")

    async with ledger.run("job", owner="user:1", run_id="run-late") as run:
        with pytest.raises(stopline.NoAnswer):
            await run.call(stopline.Tool(lose), key="k")
    op = await ledger.late_response(
        "run-late/k", stopline.Verdict.COMMITTED, result="x" * MAX_RESULT_CHARS
    )
    assert op.status is OpStatus.COMMITTED and not op.has_result and op.result is None


class Unreadable(Exception):
    """An exception whose message cannot be read: its ``str`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no message")


async def test_r2_an_exception_whose_message_cannot_be_read_leaves_an_outcome(
    ledger: stopline.Ledger,
) -> None:
    """The outcome was written with the exception's ``str``: one that raised left the
    operation ``requested`` ("sent; no answer yet") for good, and a Temporal or DBOS
    retry found it in doubt for ever."""
    async with ledger.run("job", owner="user:1", run_id="run-unreadable") as run:
        with pytest.raises(Unreadable):
            await run.call(raising(Unreadable()), key="k")
    op = await ledger.backend.get_operation("run-unreadable/k")
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
    assert op.evidence[1].detail == "Unreadable: (its message could not be read: RuntimeError)"
    assert (await ledger.wait_settled("run-unreadable", timeout=10)).settled


class RefusesWrites:
    """An observer: the ledger refuses the next ``failures`` outcome writes."""

    def __init__(self, inner: Backend, failures: int) -> None:
        self.inner = inner
        self.failures = failures

    async def record(self, op_id: str, update: OutcomeUpdate) -> Any:
        if self.failures:
            self.failures -= 1
            raise LedgerFull("test", "disk full")
        return await self.inner.record(op_id, update)

    def record_deferred(self, op_id: str, update: OutcomeUpdate, then: Any) -> None:
        if not self.failures:
            self.inner.record_deferred(op_id, update, then)
            return
        self.failures -= 1

        def failed() -> Any:
            raise LedgerFull("test", "disk full")

        then(failed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "group-commit"])
async def test_r2_a_failed_write_is_retried_until_the_ledger_takes_it(
    ledger_url: str, durable: bool
) -> None:
    observer: list[RefusesWrites] = []

    def observe(backend: Backend) -> Backend:
        observer.append(RefusesWrites(backend, failures=2))
        return cast(Backend, observer[0])

    async def send(ctx: stopline.CallContext) -> str:
        return "sent"

    async with stopline.open(
        ledger_url, verify=FAST_VERIFY, observers=[observe], durable_outcomes=durable
    ) as ledger:
        async with ledger.run("job", owner="user:1", run_id="run-disk") as run:
            with anyio.fail_after(10):
                assert await run.call(stopline.Tool(send), key="k") == "sent"
        receipt = await ledger.wait_settled("run-disk", timeout=10)
        assert receipt.lines[0].status is OpStatus.COMMITTED
        assert observer[0].failures == 0  # both refusals happened, then it was taken


async def test_r4_a_late_result_that_is_not_json_is_committed_without_it(
    ledger: stopline.Ledger,
) -> None:
    """A response that came after the answer was lost, with a result that is not JSON:
    it was recorded as kept and stored as nothing, so a replay handed back ``None`` (a
    model was told the call returned null). It is kept as an answer in time is: the
    commit proven, the result said not kept, a replay refused."""

    async def allocate(ctx: stopline.CallContext) -> set[int]:
        raise ConnectionResetError("the answer was lost")

    tool = stopline.Tool(allocate)
    with pytest.raises(ConnectionResetError):
        async with ledger.run("job", owner="user:1", run_id="run-late") as run:
            await run.call(tool, key="k")
    op = await ledger.late_response("run-late/k", stopline.Verdict.COMMITTED, result={1, 2})
    assert op.status is OpStatus.COMMITTED and not op.has_result and op.result is None
    assert op.result_not_kept is not None and "set is not JSON" in op.result_not_kept
    with pytest.raises(NotReplayable, match="set is not JSON"):
        await ledger.dispatch("run-late", tool, key="k")


async def test_r2_a_callers_cancel_due_at_the_gate_sends_nothing_and_says_so(
    ledger: stopline.Ledger,
) -> None:
    """The caller's own cancel (a deadline, a cancelled scope) came due while the gate
    recorded the intent (a wait the gate shields): the tool was started anyway, and its
    first await took the cancel, so a call that had been sent was "unknown" and went to
    human review (a tool that never awaits ran to its end and the caller never heard of
    its cancel). Now nothing is sent, and the call is recorded as not happened."""
    sent: list[str] = []

    @stopline.tool
    async def send(ctx: stopline.CallContext, text: str) -> str:
        sent.append(text)
        await anyio.lowlevel.checkpoint()
        return text

    async with ledger.run("job", owner="user:1", run_id="run-caller") as run:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await run.call(send, "x", key="cut")
        assert scope.cancelled_caught
        assert await run.call(send, "y", key="after") == "y"  # the run goes on
    receipt = await ledger.wait_settled("run-caller", timeout=10)
    assert sent == ["y"]
    (cut,) = [line for line in receipt.lines if line.op_id == "run-caller/cut"]
    assert cut.status is OpStatus.NOT_COMMITTED
    assert "not_dispatched" in [e.ref for e in cut.evidence]
    assert receipt.headline is stopline.Headline.COMPLETED


async def test_r2_an_asyncio_cancel_cutting_the_gates_wait_leaves_no_intent_behind(
    ledger_url: str,
) -> None:
    """asyncio's own ``Task.cancel`` (a framework stopping its tool's task) cut the
    caller's wait on the gate once the intent was durable (PostgreSQL's gate holds
    nothing back): the call stayed ``requested`` for good, in a live worker, and a
    reopened ledger sent it to human review as a crash. Now it is recorded as not sent,
    and the cancel goes on up. (The intent is made durable, then the gate's answer is
    held until the task is cancelled: the moment the race hit.)"""
    durable, cut = asyncio.Event(), asyncio.Event()
    sent: list[str] = []

    class Holding(ForwardingBackend):
        async def gate(self, spec: OperationSpec) -> GateResult:
            result = await self.inner.gate(spec)
            if spec.id.endswith("/held"):
                durable.set()
                await cut.wait()
            return result

    @stopline.tool
    async def send(ctx: stopline.CallContext, text: str) -> str:
        sent.append(text)
        return text

    async with stopline.open(ledger_url, observers=[Holding]) as ledger:
        async with ledger.run("job", owner="user:1", run_id="run-native") as run:
            task = asyncio.ensure_future(run.call(send, "x", key="held"))
            await durable.wait()
            task.cancel()
            cut.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await run.call(send, "y", key="after") == "y"  # the run goes on
        receipt = await ledger.wait_settled("run-native", timeout=10)
    assert sent == ["y"]
    (held,) = [line for line in receipt.lines if line.op_id == "run-native/held"]
    assert held.status is OpStatus.NOT_COMMITTED
    assert receipt.headline is stopline.Headline.COMPLETED


async def test_r2_an_asyncio_cancel_pending_as_the_gate_answers_sends_nothing(
    ledger_url: str,
) -> None:
    """asyncio's own ``Task.cancel`` asked of the caller just as the gate answered (not
    delivered yet: a scope knows nothing of it) started the tool, whose first await
    took it: the call was "unknown" though nothing need have left. Now not sent."""
    sent: list[str] = []

    class CancelledAsItAnswers(ForwardingBackend):
        async def gate(self, spec: OperationSpec) -> GateResult:
            result = await self.inner.gate(spec)
            if spec.id.endswith("/pending"):
                task = asyncio.current_task()
                assert task is not None
                task.cancel()  # asked now, delivered at the caller's next await
            return result

    @stopline.tool
    async def send(ctx: stopline.CallContext, text: str) -> str:
        sent.append(text)
        await anyio.lowlevel.checkpoint()
        return text

    async with stopline.open(ledger_url, observers=[CancelledAsItAnswers]) as ledger:
        async with ledger.run("job", owner="user:1", run_id="run-pending") as run:
            task = asyncio.ensure_future(run.call(send, "x", key="pending"))
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await run.call(send, "y", key="after") == "y"
        receipt = await ledger.wait_settled("run-pending", timeout=10)
    assert sent == ["y"]
    (pending,) = [line for line in receipt.lines if line.op_id == "run-pending/pending"]
    assert pending.status is OpStatus.NOT_COMMITTED
    assert receipt.headline is stopline.Headline.COMPLETED
