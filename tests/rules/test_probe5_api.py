"""Probe 5 of the public API from outside: two answers that were not what happened
(ADR 0089).

- A tool whose answer is an awaitable (an ``async def`` that forgot an ``await``: a
  coroutine; a Future, a Task) was recorded ``committed``, that object its result,
  while the request inside never ran (and Python warned later that it was never
  awaited). Now ``TypeError`` naming the tool and the fix, recorded as any exception of
  a tool is (``unknown``: its body may have acted before it returned), then read back;
  a coroutine not started is closed (it never runs, nor warns). A framework's ``def``
  tool, run in its thread, likewise, its answer in time or late.
- ``run = ledger.run(...)`` without ``async with``, then ``run.call(...)``: a bare
  ``AttributeError``. Now each of a run's public names reached on the scope is
  ``NoRun`` naming the fix; nothing called, nothing written.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import threading
import warnings
from collections.abc import Coroutine, Iterator
from typing import Any

import anyio
import anyio.to_thread
import pytest

import stopline
from stopline import Cause, OpStatus, ReadBack, UnknownRun, Verdict
from stopline.errors import NoRun
from stopline.integrations._frameworks import ToolSpec, stopline_tool

pytestmark = pytest.mark.timeout(30)

BARRIER_LIMIT = 20.0  # a safety net for a broken test, never a synchronisation


class Destination:
    """A provider with its ground truth: what its requests really did, by key."""

    def __init__(self) -> None:
        self.posted: list[str] = []
        self.made: list[Coroutine[Any, Any, str]] = []  # the coroutines a tool forgot

    async def post(self, key: str) -> str:
        self.posted.append(key)
        return key

    def forgotten(self, key: str) -> Coroutine[Any, Any, str]:
        """``client.post(x)`` without its ``await``: a coroutine, never started."""
        made = self.post(key)
        self.made.append(made)
        return made

    async def verify(self, ctx: stopline.CallContext) -> ReadBack:
        there = ctx.key in self.posted
        return ReadBack(Verdict.COMMITTED if there else Verdict.NOT_COMMITTED, ended=True)


@pytest.fixture
def no_unawaited_warning() -> Iterator[None]:
    """No "coroutine ... was never awaited" escapes: what the test made is collected
    here, its warnings recorded (a finalizer's warning is otherwise lost to the
    collector's timing) and none may be that one."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
        gc.collect()
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []


async def op_of(ledger: stopline.Ledger, op_id: str) -> stopline.OperationRecord:
    return await ledger.backend.get_operation(op_id)


@pytest.mark.usefixtures("no_unawaited_warning")
async def test_a_tool_returning_an_unawaited_coroutine_is_not_committed(
    ledger: stopline.Ledger,
) -> None:
    """It was ``committed`` with the coroutine as its result, the request never sent.
    Now the caller gets ``TypeError`` naming the tool and the fix; the operation is
    ``unknown`` (cause ``local_error``, the error as its evidence), then, with no
    read-back, in review: its body may have acted before it returned. The coroutine is
    closed: its request never runs."""
    dest = Destination()

    async def send(ctx: stopline.CallContext, amount: int) -> str:
        return dest.forgotten(ctx.key)  # type: ignore[return-value]  # the bug probed

    with pytest.raises(TypeError) as raised:
        async with ledger.run("job", owner="user:1", run_id="run-coro") as run:
            await run.call(stopline.Tool(send, name="send"), 5, key="k")
    message = str(raised.value)
    assert "tool 'send' returned an unawaited coroutine" in message
    assert "never ran" in message and "await it inside the tool" in message
    assert [inspect.getcoroutinestate(c) for c in dest.made] == [inspect.CORO_CLOSED]
    assert dest.posted == []
    receipt = await ledger.wait_settled("run-coro", timeout=10)
    op = await op_of(ledger, "run-coro/k")
    assert op.status is OpStatus.NEEDS_REVIEW and op.cause is Cause.LOCAL_ERROR
    assert op.result is None
    assert [e.detail for e in op.evidence if e.ref == "local_error"] == [f"TypeError: {message}"]
    (line,) = receipt.lines
    assert line.status is OpStatus.NEEDS_REVIEW and "outcome unknown" in line.status_words
    assert receipt.headline is stopline.Headline.NEEDS_REVIEW


@pytest.mark.usefixtures("no_unawaited_warning")
@pytest.mark.parametrize("acted", [True, False], ids=["body-acted", "body-did-not"])
async def test_a_forgotten_await_is_read_back_to_what_the_body_did(
    ledger: stopline.Ledger, acted: bool
) -> None:
    """Never "not committed" is said for the tool's own body: what it did before it
    returned the coroutine is read back from the destination, committed or not."""
    dest = Destination()

    async def send(ctx: stopline.CallContext) -> str:
        if acted:
            await dest.post(ctx.key)  # the first request awaited, the second forgotten
        return dest.forgotten(f"{ctx.key}:second")  # type: ignore[return-value]

    tool: stopline.Tool[str] = stopline.Tool(send, name="send")
    tool.verifier(dest.verify)
    with pytest.raises(TypeError, match="unawaited coroutine"):
        async with ledger.run("job", owner="user:1", run_id="run-read") as run:
            await run.call(tool, key="k")
    await ledger.wait_settled("run-read", timeout=10)
    op = await op_of(ledger, "run-read/k")
    assert op.status is (OpStatus.COMMITTED if acted else OpStatus.NOT_COMMITTED)
    assert any("unawaited coroutine" in e.detail for e in op.evidence)
    assert dest.posted == (["run-read/k"] if acted else [])  # the second never ran


@pytest.mark.parametrize("kind", ["future", "task"])
async def test_a_tool_returning_a_future_or_a_task_is_not_committed(
    ledger: stopline.Ledger, kind: str
) -> None:
    """A Future or a Task is no answer either; it is left as it is (it may be shared:
    cancelling it would cancel others' work) and what it does may still land, which is
    why the operation is ``unknown``, never "not committed"."""
    dest = Destination()
    release = asyncio.Event()
    made: list[asyncio.Future[str]] = []

    async def later(key: str) -> str:
        await release.wait()
        return await dest.post(key)

    async def send(ctx: stopline.CallContext) -> str:
        loop = asyncio.get_running_loop()
        made.append(loop.create_future() if kind == "future" else loop.create_task(later(ctx.key)))
        return made[0]  # type: ignore[return-value]  # the bug probed

    with pytest.raises(TypeError) as raised:
        async with ledger.run("job", owner="user:1", run_id="run-fut") as run:
            await run.call(stopline.Tool(send, name="send"), key="k")
    expected = "Future" if kind == "future" else "Task"
    assert f"tool 'send' returned an awaitable ({expected})" in str(raised.value)
    assert "may still run" in str(raised.value)
    op = await op_of(ledger, "run-fut/k")
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
    assert op.cause is Cause.LOCAL_ERROR
    (left,) = made
    assert not left.cancelled() and not left.done()  # not ours to cancel
    if kind == "future":
        left.set_result("theirs")
    else:
        release.set()
        assert await left == "run-fut/k"  # it landed after the call: hence "unknown"
    assert dest.posted == ([] if kind == "future" else ["run-fut/k"])


@pytest.mark.usefixtures("no_unawaited_warning")
async def test_a_read_returning_an_unawaited_coroutine_is_a_type_error(
    ledger: stopline.Ledger,
) -> None:
    """A read (no gate record) answered its caller with the coroutine, left to warn."""
    dest = Destination()

    async def look(key: str) -> str:
        return dest.forgotten(key)  # type: ignore[return-value]  # the bug probed

    async with ledger.run("job", owner="user:1", run_id="run-look") as run:
        with pytest.raises(TypeError, match="tool 'look' returned an unawaited coroutine"):
            await run.call(stopline.Tool(look, effects=False), "x")
    assert [inspect.getcoroutinestate(c) for c in dest.made] == [inspect.CORO_CLOSED]
    assert await ledger.backend.operations("run-look") == []


# -- a framework's ``def`` tool, run in its worker thread (``_detached``) -----------------


class SyncSender:
    """A ``def`` tool that returns ``client.post(x)``: a coroutine made in its thread."""

    def __init__(self, dest: Destination, *, hold: bool) -> None:
        self.dest = dest
        self.hold = hold
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, note: str) -> str:
        if self.hold:
            self.reached.set()
            self.release.wait(BARRIER_LIMIT)
        return self.dest.forgotten(note)  # type: ignore[return-value]  # the bug probed


@pytest.mark.usefixtures("no_unawaited_warning")
async def test_a_def_tool_in_its_thread_returning_a_coroutine_is_not_committed(
    ledger: stopline.Ledger,
) -> None:
    """Its answer in time: the gate records the ``TypeError`` as a tool's exception."""
    dest = Destination()
    tool = stopline_tool(SyncSender(dest, hold=False), "write", ToolSpec())
    with pytest.raises(TypeError, match="tool 'write' returned an unawaited coroutine"):
        async with ledger.run("job", owner="user:1", run_id="run-thread") as run:
            await run.call(tool, "n1", key="k")
    op = await op_of(ledger, "run-thread/k")
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
    assert op.cause is Cause.LOCAL_ERROR
    assert [inspect.getcoroutinestate(c) for c in dest.made] == [inspect.CORO_CLOSED]
    assert dest.posted == []


@pytest.mark.usefixtures("no_unawaited_warning")
async def test_a_def_tool_returning_a_coroutine_late_is_not_committed_late(
    ledger: stopline.Ledger,
) -> None:
    """Its answer late (its caller cut while the thread ran): the late answer was
    attached as ``committed``, the coroutine its result. Now it is kept as a late answer
    that proves nothing (``late: TypeError``, R4) and the operation stays in doubt: with
    no read-back of its own, in review."""
    dest = Destination()
    sender = SyncSender(dest, hold=True)
    tool = stopline_tool(sender, "write", ToolSpec())
    try:
        async with ledger.run("job", owner="user:1", run_id="run-late") as run:
            with anyio.CancelScope() as cut:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: run.call(tool, "n1", key="k"))
                    await anyio.to_thread.run_sync(sender.reached.wait, BARRIER_LIMIT)
                    cut.cancel()  # the caller stops waiting; the thread goes on
            assert (await op_of(ledger, "run-late/k")).status is OpStatus.UNKNOWN
    finally:
        sender.release.set()
    await ledger.wait_settled("run-late", timeout=10)
    op = await op_of(ledger, "run-late/k")
    assert op.status is OpStatus.NEEDS_REVIEW, op
    assert op.result is None and not any("late" in e.detail for e in op.evidence)
    kept = [e for e in await ledger.backend.events("run-late") if e.kind == "late_response"]
    assert len(kept) == 1 and "late: TypeError: tool 'write' returned an unawaited" in str(
        kept[0].data
    )
    assert [inspect.getcoroutinestate(c) for c in dest.made] == [inspect.CORO_CLOSED]
    assert dest.posted == []


# -- a run's scope used as the run (``async with`` forgotten) ------------------------------


async def test_a_run_used_without_async_with_is_no_run_naming_the_fix(
    ledger: stopline.Ledger,
) -> None:
    """``run = ledger.run(...)`` then ``await run.call(tool, ...)``: ``AttributeError:
    'RunScope' object has no attribute 'call'``. Each public name of a run (those of an
    entered one, read here) is ``NoRun`` on the scope, naming ``async with``; the tool
    is not called, nothing is written, and the scope can still be entered. A name no
    run has is still an ``AttributeError`` (``hasattr`` and ``getattr`` with a default
    keep working)."""
    sent: list[str] = []

    async def send(ctx: stopline.CallContext) -> str:
        sent.append(ctx.key)
        return "sent"

    tool: stopline.Tool[str] = stopline.Tool(send)
    async with ledger.run("job", owner="user:1", run_id="run-other") as entered:
        public = [n for n in dir(entered) if not n.startswith("_")]
        child = entered.child("sub")
    assert {"call", "call_with", "checkpoint", "id", "receipt", "boundary"} <= set(public)
    scope = ledger.run("job", owner="user:1", run_id="run-forgot")
    for name in public:
        with pytest.raises(NoRun) as refused:
            getattr(scope, name)
        assert "async with ledger.run(...) as run" in str(refused.value), name
        assert f"run.{name}" in str(refused.value), name
    with pytest.raises(NoRun, match=r"`call` is a run's"):
        # typed, the scope has no ``call`` (an unused ignore fails ``mypy --strict``)
        await scope.call(tool, key="k")  # type: ignore[attr-defined]
    with pytest.raises(NoRun):
        child.call  # type: ignore[attr-defined]  # noqa: B018  # a child's scope too
    assert sent == []
    with pytest.raises(UnknownRun):
        await ledger.backend.get_run("run-forgot")
    assert not hasattr(scope, "nothing_a_run_has")
    assert getattr(scope, "__deepcopy__", None) is None
    with pytest.raises(AttributeError, match="nothing_a_run_has"):
        scope.nothing_a_run_has  # type: ignore[attr-defined]  # noqa: B018
    async with scope as run:  # the fix the error names
        assert await run.call(tool, key="k") == "sent"
    assert sent == ["run-forgot/k"]
    assert (await ledger.backend.get_run("run-forgot")).state is stopline.RunState.COMPLETED


@pytest.mark.usefixtures("no_unawaited_warning")
async def test_a_compensator_returning_an_unawaited_coroutine_is_not_compensated(
    ledger: stopline.Ledger,
) -> None:
    """A compensator that forgot its ``await`` was recorded as a correction that
    happened (``compensated``), its refund never sent. Its answer goes through the same
    ``Tool.answer``: the correction is in doubt (``local_error``), in review, and the
    coroutine is closed."""
    dest = Destination()

    async def charge(ctx: stopline.CallContext) -> str:
        return await dest.post(ctx.key)

    tool: stopline.Tool[str] = stopline.Tool(charge, name="charge")

    @tool.compensator
    async def refund(ctx: stopline.CallContext) -> str:
        return dest.forgotten(f"refund:{ctx.key}")  # type: ignore[return-value]

    async with ledger.run("job", owner="user:1", run_id="run-comp") as run:
        await run.call(tool, key="k")
    corrected = await ledger.compensate("run-comp/k", by="user:1", reason="refund it")
    assert corrected.status is not OpStatus.COMPENSATED, corrected.status
    assert len(dest.posted) == 1  # the charge; the refund never ran
    assert [inspect.getcoroutinestate(c) for c in dest.made] == [inspect.CORO_CLOSED]
    (correction,) = [
        op for op in await ledger.backend.operations("run-comp") if op.compensates is not None
    ]
    assert correction.status is not OpStatus.COMMITTED and correction.cause is Cause.LOCAL_ERROR
    assert any(
        "the compensator of tool 'charge' returned an unawaited coroutine" in e.detail
        for e in correction.evidence
    ), [e.detail for e in correction.evidence]


@pytest.mark.usefixtures("no_unawaited_warning")
async def test_a_verifier_returning_an_unawaited_coroutine_decides_nothing(
    ledger: stopline.Ledger,
) -> None:
    """A verifier that forgot its ``await`` was refused as no verdict, its coroutine left
    to warn that it was never awaited. It is closed, and the refusal names the fix; the
    operation stays in doubt."""
    dest = Destination()
    reached = anyio.Event()

    async def send(ctx: stopline.CallContext) -> str:
        raise stopline.NoAnswer(Cause.TRANSPORT, "the reply was lost")

    async def look(ctx: stopline.CallContext) -> ReadBack:
        reached.set()
        return dest.verify(ctx)  # type: ignore[return-value]  # the bug probed

    tool: stopline.Tool[str] = stopline.Tool(send, name="send")
    tool.verifier(look)
    with pytest.raises(stopline.NoAnswer):
        async with ledger.run("job", owner="user:1", run_id="run-look") as run:
            await run.call(tool, key="k")
    with anyio.fail_after(BARRIER_LIMIT):
        await reached.wait()
    await ledger.wait_settled("run-look", timeout=10)
    op = await op_of(ledger, "run-look/k")
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW), op.status
    events = await ledger.backend.events("run-look")
    said = " ".join(str(e.data) for e in events)
    assert "a verifier returned an unawaited coroutine" in said, said
    assert "await it inside the verifier" in said
