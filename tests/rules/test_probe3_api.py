"""Probe 3 of the public API from outside: what a library user passes and how a user
gets it wrong, on a real SQLite file and a real PostgreSQL. Each wrong input or use is
a typed error naming the problem, before anything is written or sent (ADR 0078)."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.to_thread
import pytest

import stopline
from stopline import (
    InvalidInput,
    LedgerClosed,
    OpStatus,
    Policy,
    ReadBack,
    RunState,
    Verdict,
    WrongEventLoop,
)
from stopline.errors import NoRun
from stopline.ledger.backend import RunSpec
from stopline.testing import FakeProvider

pytestmark = pytest.mark.timeout(30)

# U+202E made "refund-0001" read as "refund-1000" wherever text is not shown escaped;
# U+2066 opens an isolate; U+009B is a CSI to some terminals
NOT_NEW = {"rlo": "a\u202eb", "lri": "a\u2066b", "lrm": "a\u200eb", "csi": "a\x9bb"}


async def _nothing_written(ledger: stopline.Ledger) -> None:
    assert await ledger.backend.list_runs(limit=10) == []


@pytest.mark.parametrize("bad", list(NOT_NEW), ids=list(NOT_NEW))
@pytest.mark.parametrize("field", ["run_id", "owner", "tenant"])
async def test_a_run_made_with_a_bidi_or_c1_control_in_an_id_is_refused_naming_it(
    ledger: stopline.Ledger, field: str, bad: str
) -> None:
    given: dict[str, Any] = {"name": "job", "owner": "user:1", field: NOT_NEW[bad]}
    name, owner = given.pop("name"), given.pop("owner")
    with pytest.raises(InvalidInput) as refused:
        async with ledger.run(name, owner=owner, **given):
            pass
    assert refused.value.what == field and f"<U+{ord(NOT_NEW[bad][1]):04X}>" in str(refused.value)
    await _nothing_written(ledger)


@pytest.mark.parametrize("bad", list(NOT_NEW), ids=list(NOT_NEW))
async def test_a_key_or_a_tool_name_with_a_bidi_or_c1_control_is_refused_before_the_gate(
    ledger: stopline.Ledger, bad: str
) -> None:
    provider = FakeProvider("send")
    with pytest.raises(InvalidInput) as refused:
        stopline.Tool(provider.tool.fn, name=f"send{NOT_NEW[bad]}")
    assert refused.value.what == "tool"
    async with ledger.run("job", owner="user:1", run_id="run-keys") as run:
        with pytest.raises(InvalidInput) as refused:
            await run.call(provider.tool, 1, key=f"refund{NOT_NEW[bad]}")
        assert refused.value.what == "key"
    assert await ledger.backend.operations("run-keys") == [] and provider.requests == []


async def test_a_run_stored_with_a_bidi_id_before_the_rule_is_still_reached_by_it(
    ledger: stopline.Ledger,
) -> None:
    """An id is refused when it is made, never when it is looked up: a run a ledger holds
    from before is still read, entered and cancelled by its id (a fence never weakened)."""
    old = "run\u202e-old"
    await ledger.backend.create_run(RunSpec(id=old, name="job", owner="user:1", tenant="default"))
    provider = FakeProvider("send")
    async with ledger.run("job", owner="user:1", run_id=old) as run:
        await run.call(provider.tool, 1, key="first")
    assert (await ledger.receipt(old)).run_state is RunState.COMPLETED
    await ledger.backend.create_run(
        RunSpec(id=f"{old}-2", name="job", owner="user:1", tenant="default")
    )
    await ledger.cancel(f"{old}-2", by="user:1")
    assert (await ledger.wait_settled(f"{old}-2", timeout=10)).run_state is RunState.CANCELLED


async def test_a_second_tool_declared_otherwise_under_a_known_name_is_refused(
    ledger: stopline.Ledger,
) -> None:
    """Tools are known by name (the ledger records a call's tool by its name): a second
    ``pay`` without the first's verifier was read back with the first's, and an
    operation it never proved was recorded committed. Refused before the gate."""
    sent: list[str] = []

    async def read_back(ctx: stopline.CallContext) -> ReadBack:
        return ReadBack(Verdict.COMMITTED, "pay-a")

    @stopline.tool(name="pay")
    async def pay_a(ctx: stopline.CallContext, amount: int) -> str:
        sent.append(f"a:{amount}")
        return "a"

    pay_a.verifier(read_back)

    @stopline.tool(name="pay")
    async def pay_b(ctx: stopline.CallContext, amount: int) -> str:
        sent.append(f"b:{amount}")
        return "b"

    async with ledger.run("job", owner="user:1", run_id="run-two-pays") as run:
        assert await run.call(pay_a, 1, key="one") == "a"
        with pytest.raises(InvalidInput) as refused:
            await run.call(pay_b, 2, key="two")
        assert refused.value.what == "tool" and "'pay'" in str(refused.value)
        with pytest.raises(InvalidInput):
            ledger.register_tool(pay_b)
        # the same declaration again (a tool made anew from it) is the same tool
        again: stopline.Tool[str] = stopline.Tool(pay_a.fn, name="pay")
        again.verifier(read_back)
        ledger.register_tool(again)
        assert await run.call(again, 3, key="three") == "a"
    ops = await ledger.backend.operations("run-two-pays")
    assert [op.id for op in ops] == ["run-two-pays/one", "run-two-pays/three"]
    assert sent == ["a:1", "a:3"]


def test_tools_given_at_open_under_one_name_must_be_one_tool() -> None:
    async def post(ctx: stopline.CallContext) -> None: ...

    async def read(ctx: stopline.CallContext) -> Verdict:
        return Verdict.UNKNOWN

    declared = stopline.Tool(post)
    with_partial = stopline.Tool(post)
    with_partial.verify_fn = functools.partial(read)
    same = stopline.Tool(post)
    same.verify_fn = functools.partial(read)  # made again: equal
    stopline.open("sqlite:///unused.db", tools=[with_partial, same])  # nothing opened
    with pytest.raises(InvalidInput) as refused:
        stopline.open("sqlite:///unused.db", tools=[declared, with_partial])
    assert refused.value.what == "tool"
    policy = stopline.Tool(post, cancellable=stopline.Cancellable.UNTIL_ACCEPTED)
    with pytest.raises(InvalidInput):
        stopline.open("sqlite:///unused.db", tools=[declared, policy])


@pytest.mark.parametrize("thing", [42, None, "send"], ids=["int", "none", "str"])
async def test_what_is_not_callable_is_refused_as_a_tool_before_the_gate(
    ledger: stopline.Ledger, thing: Any
) -> None:
    """``run.call(42)`` passed the gate, then failed: an operation in doubt (``unknown``,
    sent to review) for a call that never left."""
    async with ledger.run("job", owner="user:1", run_id="run-thing") as run:
        with pytest.raises(InvalidInput) as refused:
            await run.call(thing)
        assert refused.value.what == "tool"
    assert await ledger.backend.operations("run-thing") == []


async def test_a_tool_called_directly_is_a_typed_error_and_sends_nothing() -> None:
    provider = FakeProvider("send")
    direct = cast("Callable[..., object]", provider.tool)  # typed, a tool is no callable
    with pytest.raises(NoRun, match=r"run\.call"):
        direct(1)  # what an untyped caller does
    with pytest.raises(InvalidInput, match="a tool already"):
        stopline.Tool(cast("Callable[..., Awaitable[Any]]", provider.tool))
    assert provider.requests == []


def _nested(depth: int) -> list[Any]:
    top: list[Any] = []
    inner = top
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return top


async def test_arguments_no_digest_can_be_taken_of_are_refused_naming_them(
    ledger: stopline.Ledger,
) -> None:
    """Nested past Python's recursion limit, or an integer past its digits limit: a
    ``RecursionError`` or a ``ValueError`` left the call. Refused naming the arguments,
    unless a key names the call (its arguments are then not compared)."""
    sent: list[str] = []

    @stopline.tool
    async def send(ctx: stopline.CallContext, payload: object) -> str:
        sent.append(ctx.key)
        return "sent"

    async with ledger.run("job", owner="user:1", run_id="run-args") as run:
        for bad in (_nested(100_000), 10**5000):
            with pytest.raises(InvalidInput) as refused:
                await run.call(send, bad)
            assert refused.value.what == "arguments"
        assert await ledger.backend.operations("run-args") == [] and sent == []
        assert await run.call(send, _nested(100_000), key="named") == "sent"
    (op,) = await ledger.backend.operations("run-args")
    assert op.status is OpStatus.COMMITTED and op.args_digest.startswith("unstable:")


async def test_a_closed_ledger_is_one_typed_error_on_both_engines(ledger_url: str) -> None:
    """After its block: a bare ``RuntimeError`` on SQLite and ``LedgerUnavailable`` (a
    fault to wait out) on PostgreSQL. A ledger opens once."""
    provider = FakeProvider("send")
    async with (
        stopline.open(ledger_url) as ledger,
        ledger.run("job", owner="user:1", run_id="run-closed") as run,
    ):
        pass
    uses: dict[str, Callable[[], Awaitable[object]]] = {
        "run": ledger.run("job", owner="user:1").__aenter__,
        "call": lambda: run.call(provider.tool, 1, key="after"),
        "cancel": lambda: ledger.cancel("run-closed", by="user:1"),
        "receipt": lambda: ledger.receipt("run-closed"),
        "reopen": ledger.__aenter__,
    }
    for what, use in uses.items():
        with pytest.raises(LedgerClosed, match="is closed") as refused:
            await use()
        assert isinstance(refused.value, RuntimeError), what
    assert provider.requests == []
    async with stopline.open(ledger_url) as again:  # a new one opens it
        assert [op.id for op in await again.backend.operations("run-closed")] == []


async def test_a_ledger_not_opened_yet_is_the_same_typed_error(tmp_path: Path) -> None:
    ledger = stopline.open(f"sqlite:///{tmp_path / 'l.db'}")
    with pytest.raises(LedgerClosed, match="not open"):
        await ledger.receipt("x")
    assert not (tmp_path / "l.db").exists()


async def test_a_second_cancel_with_another_reason_keeps_the_first(
    ledger: stopline.Ledger,
) -> None:
    async with ledger.run("job", owner="user:1", run_id="run-twice") as run:
        first = await ledger.cancel(run.id, by="user:1", reason="first")
        second = await ledger.cancel(run.id, by="user:1", reason="second")
    assert first.cancel_reason == second.cancel_reason == "first"
    settled = await ledger.wait_settled("run-twice", timeout=10)
    assert settled.cancel_reason == "first" and settled.run_state is RunState.CANCELLED


def _in_another_loop(make: Callable[[], Awaitable[Any]]) -> BaseException | Any:
    """What ``make()`` gives, awaited in a new event loop of another thread."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(asyncio.run(asyncio.wait_for(make(), 10)))
        except BaseException as exc:  # the answer, whatever it is
            out.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(15)
    return out[0] if out else TimeoutError("the other loop did not answer")


async def test_a_run_entered_or_called_from_another_threads_loop_is_refused(
    ledger: stopline.Ledger,
) -> None:
    """The block of a run entered in another thread's loop was interrupted by cancels
    delivered in the ledger's: it worked until the first cancel. Refused, typed."""
    provider = FakeProvider("send")

    async def enter() -> None:
        async with ledger.run("job", owner="user:1", run_id="run-elsewhere"):
            pass

    async with ledger.run("job", owner="user:1", run_id="run-here") as run:
        for use in (enter, lambda: run.call(provider.tool, 1, key="there")):
            refused = await anyio.to_thread.run_sync(_in_another_loop, use)
            assert isinstance(refused, WrongEventLoop) and isinstance(refused, RuntimeError)
        assert await run.call(provider.tool, 1, key="here") is not None
    assert [r.id for r in await ledger.backend.list_runs(limit=10)] == ["run-here"]
    assert [op.id for op in await ledger.backend.operations("run-here")] == ["run-here/here"]
    assert len(provider.requests) == 1


async def test_a_cancel_from_another_threads_loop_ends_the_block_quietly(tmp_path: Path) -> None:
    """A console served from another thread (Starlette's TestClient, a sync framework)
    cancelling a run of this loop: the cut was made in that thread, and the run's
    block raised a bare ``CancelledError`` out of ``async with``. Delivered in the
    ledger's own loop, the block ends quietly and the call is interrupted. (SQLite's:
    PostgreSQL's connections are bound to the ledger's loop, and a read made from
    another loop may wait out its 10 s answer timeout first: one loop per PostgreSQL
    ledger, docs/lifecycle.md.)"""
    async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        await _cut_from_another_thread(ledger)


async def _cut_from_another_thread(ledger: stopline.Ledger) -> None:
    reached = threading.Event()
    never = anyio.Event()

    @stopline.tool
    async def hold(ctx: stopline.CallContext) -> str:
        reached.set()
        await never.wait()
        return "answered"

    def cancel_there() -> Any:
        reached.wait(10)
        return _in_another_loop(lambda: ledger.cancel("run-cut", by="user:1", reason="there"))

    answers: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def cancel() -> None:
            answers.append(await anyio.to_thread.run_sync(cancel_there))

        tg.start_soon(cancel)
        async with ledger.run(
            "job", owner="user:1", run_id="run-cut", policy=Policy.IMMEDIATE
        ) as run:
            answers.append(await run.call(hold, key="held"))
    assert not never.is_set() and answers[0].cancel_reason == "there"  # no "answered"
    assert run.cancelled_caught
    settled = await ledger.wait_settled("run-cut", timeout=10)
    assert settled.run_state.fenced and settled.cancel_reason == "there"
    op = await ledger.backend.get_operation("run-cut/held")  # cut, no read-back: a person's
    assert op.status is OpStatus.NEEDS_REVIEW
