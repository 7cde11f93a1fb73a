"""Probe 4 of the public API from outside: the holes ADR 0078 left (ADR 0086).

- One tool per name: two methods of one class bound to two instances (two
  destinations) were taken as one declaration, and the second's calls were read back
  with the first instance's verifier.
- A PostgreSQL ledger used from another thread's event loop: a read or a cancel there
  could wait out the 10 s answer timeout, or cost the ledger's own worker its lease.
  Refused at once, typed, naming the fix; nothing written.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

import stopline
from stopline import InvalidInput, ReadBack, RunState, Verdict, WrongEventLoop
from stopline.telemetry import Telemetry
from tests.rules.test_probe3_api import _in_another_loop

pytestmark = pytest.mark.timeout(30)


class Account:
    """A user's provider object: one per destination, its methods the tool's."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sent: list[str] = []

    async def send(self, ctx: stopline.CallContext, amount: int) -> str:
        self.sent.append(ctx.key)
        return f"{self.name}:{amount}"

    async def verify(self, ctx: stopline.CallContext) -> ReadBack:
        found = ctx.key in self.sent
        return ReadBack(Verdict.COMMITTED if found else Verdict.NOT_COMMITTED, self.name)

    def tool(self) -> stopline.Tool[str]:
        made: stopline.Tool[str] = stopline.Tool(self.send, name="send")
        made.verifier(self.verify)
        return made


async def test_methods_of_two_instances_under_one_name_are_two_tools(
    ledger: stopline.Ledger,
) -> None:
    """``a.send`` and ``b.send`` (two accounts) under one name: the second was taken,
    and its operations read back with ``a.verify``, which never saw them ("not there":
    the guidance would send them again). Refused before the gate; the same account's
    tool made again is the same declaration."""
    a, b = Account("a"), Account("b")
    async with ledger.run("job", owner="user:1", run_id="run-accounts") as run:
        assert await run.call(a.tool(), 1, key="one") == "a:1"
        with pytest.raises(InvalidInput) as refused:
            await run.call(b.tool(), 2, key="two")
        assert refused.value.what == "tool" and "'send'" in str(refused.value)
        with pytest.raises(InvalidInput):
            ledger.register_tool(b.tool())
        assert await run.call(a.tool(), 3, key="three") == "a:3"  # made again: one
    ops = await ledger.backend.operations("run-accounts")
    assert [op.id for op in ops] == ["run-accounts/one", "run-accounts/three"]
    assert (a.sent, b.sent) == (["run-accounts/one", "run-accounts/three"], [])


@dataclasses.dataclass(frozen=True)
class Mailbox:
    """A provider object that says when two of it are one destination: equal."""

    address: str

    async def post(self, ctx: stopline.CallContext) -> str:
        return self.address

    async def verify(self, ctx: stopline.CallContext) -> Verdict:
        return Verdict.UNKNOWN


def test_methods_of_equal_instances_are_one_declaration() -> None:
    """An object made again for each call declares, by its equality, that it reads back
    what the other does (as the framework adapters' per-call objects do)."""

    def made(box: Mailbox) -> stopline.Tool[str]:
        tool: stopline.Tool[str] = stopline.Tool(box.post, name="post")
        tool.verifier(box.verify)
        return tool

    stopline.open("sqlite:///unused.db", tools=[made(Mailbox("x")), made(Mailbox("x"))])
    with pytest.raises(InvalidInput) as refused:
        stopline.open("sqlite:///unused.db", tools=[made(Mailbox("x")), made(Mailbox("y"))])
    assert refused.value.what == "tool"


# -- a PostgreSQL ledger from another thread's event loop ------------------------------


async def test_a_postgres_ledger_read_or_cancelled_from_another_loop_is_refused_at_once(
    pg_url: str,
) -> None:
    """Reads, receipts, listings and cancels from another thread's loop used the ledger's
    pool and group commit from there: a read could wait out the 10 s answer timeout (and
    fail ``LedgerUnavailable``), and the ledger's own worker lose its lease. Now
    ``WrongEventLoop`` at once, naming the fix, nothing written; the ledger's own loop
    goes on, and the fix the error names (the call handed to the ledger's loop) works."""
    async with stopline.open(pg_url) as ledger:
        async with ledger.run("job", owner="user:1", run_id="run-done"):
            pass
        async with ledger.run("job", owner="user:1", run_id="run-open") as run:

            async def through_the_backend() -> object:  # ``ledger.backend`` read there
                return await ledger.backend.get_run("run-done")

            uses: dict[str, Callable[[], Awaitable[object]]] = {
                "receipt": lambda: ledger.receipt("run-done"),
                "receipts": lambda: ledger.receipts(["run-done"]),
                "listing": lambda: ledger.runs_with_receipts(limit=5),
                "reads": lambda: ledger.reads.runs(limit=5),
                "backend": through_the_backend,
                "cancel": lambda: ledger.cancel("run-open", by="user:1", reason="there"),
                "pause": lambda: ledger.pause("run-open", by="user:1"),
                "wait_settled": lambda: ledger.wait_settled("run-done", timeout=5),
            }
            for what, use in uses.items():
                refused = await anyio.to_thread.run_sync(_in_another_loop, use)
                assert isinstance(refused, WrongEventLoop), (what, refused)
                assert "PostgreSQL" in str(refused) and "run_coroutine_threadsafe" in str(refused)
            assert not run.cancel_requested
            assert (await ledger.backend.get_run("run-open")).state is RunState.RUNNING

            loop = asyncio.get_running_loop()

            async def handed() -> stopline.Receipt:  # the fix: the ledger's loop reads
                future = asyncio.run_coroutine_threadsafe(ledger.receipt("run-done"), loop)
                return await asyncio.wrap_future(future)

            answered = await anyio.to_thread.run_sync(_in_another_loop, handed)
            assert isinstance(answered, stopline.Receipt), answered
            assert answered.run_state is RunState.COMPLETED
        # a worker thread of the ledger's own loop runs no loop: it is not refused
        assert await anyio.to_thread.run_sync(lambda: ledger.backend.location)
        assert (await ledger.receipt("run-open")).run_state is RunState.COMPLETED


async def test_a_postgres_ledger_under_an_observer_is_refused_from_another_loop(
    pg_url: str, tmp_path: Path
) -> None:
    """The loop a ledger's connections belong to is its backend's own fact
    (``Backend.bound_to_its_loop``), told through every observer that wraps it: a
    PostgreSQL ledger opened with telemetry is refused from another thread's loop as a
    bare one is, and a SQLite ledger (a file any thread's loop may read) is not."""
    async with stopline.open(pg_url, observers=[Telemetry()]) as ledger:
        refused = await anyio.to_thread.run_sync(_in_another_loop, lambda: ledger.reads.runs())
        assert isinstance(refused, WrongEventLoop), refused
    async with stopline.open(f"sqlite:///{tmp_path / 'any.db'}", observers=[Telemetry()]) as db:
        listed = await anyio.to_thread.run_sync(_in_another_loop, lambda: db.reads.runs())
        assert listed == [], listed


async def test_arguments_the_tool_cannot_take_are_refused_before_the_gate(
    ledger: stopline.Ledger,
) -> None:
    """A call its function could not take (a keyword-only argument left out, one too
    many) raised ``TypeError`` after the gate: an operation ``unknown``, sent to be read
    back, for a call that never ran. Refused naming the arguments, nothing written;
    ``*args``, ``**kwargs``, defaults and keyword-only arguments are taken as Python
    takes them, through a ``functools.partial`` and a callable object too."""
    ran: list[object] = []

    @stopline.tool
    async def pay(ctx: stopline.CallContext, to: str, amount: int = 1, *, memo: str) -> str:
        ran.append((to, amount, memo))
        return f"{to}:{amount}:{memo}"

    @stopline.tool
    async def spread(ctx: stopline.CallContext, *args: int, **kwargs: int) -> int:
        return sum(args) + sum(kwargs.values())

    class Doubler:
        async def __call__(self, ctx: stopline.CallContext, n: int) -> int:
            return 2 * n

    async with ledger.run("job", owner="user:1", run_id="run-fit") as run:
        for args, kwargs in (((), {"memo": "m"}), (("bob",), {}), (("bob", 1, 2), {"memo": "m"})):
            with pytest.raises(InvalidInput) as refused:
                await run.call_with(pay, args, kwargs)
            assert refused.value.what == "arguments" and "'pay'" in str(refused.value)
        with pytest.raises(InvalidInput):
            await run.call(Doubler(), 1, 2)
        assert await ledger.backend.operations("run-fit") == [] and ran == []
        assert await run.call(pay, "bob", memo="m") == "bob:1:m"
        assert await run.call(spread, 1, 2, c=3) == 6
        assert await run.call(Doubler(), 4) == 8
        assert await run.call(stopline.tool(name="to_ann")(_partial_pay(pay)), memo="x")
    assert len(await ledger.backend.operations("run-fit")) == 4


def _partial_pay(pay: stopline.Tool[str]) -> Callable[..., Awaitable[str]]:
    return functools.partial(pay.fn, to="ann")


def test_a_call_shape_taken_once_does_not_let_another_through() -> None:
    """``arguments_fit`` remembers the shapes (positional count, keyword names) its
    function took, so the gate's path binds nothing the second time: a shape taken
    says nothing of another, and one refused is refused again."""

    @stopline.tool
    async def pay(ctx: stopline.CallContext, to: str, amount: int = 1, *, memo: str) -> str:
        return f"{to}:{amount}:{memo}"

    for _ in range(2):
        pay.check_arguments(("bob",), {"memo": "m"})  # taken, then from the shapes kept
        pay.check_arguments(("bob", 2), {"memo": "m"})
        for args, kwargs in ((("bob",), {}), (("bob",), {"memo": "m", "to": "x"})):
            with pytest.raises(InvalidInput, match="cannot take them"):
                pay.check_arguments(args, kwargs)


async def test_a_correction_or_a_decision_from_another_loop_is_refused(tmp_path: Path) -> None:
    """A SQLite ledger may be read from another thread's loop, but a correction started
    there ran its background work in that loop, and ended with it unfinished: its record
    left ``compensating`` and the ledger's close waited for it for ever (a test of the
    embedded console hung in teardown so). A correction, its stop and a review's
    decision from another loop are ``WrongEventLoop`` naming the fix, nothing written;
    the same from the ledger's loop correct it."""
    refunded: list[str] = []

    async def charge(ctx: stopline.CallContext) -> str:
        return ctx.key

    tool: stopline.Tool[str] = stopline.Tool(charge, name="charge")

    @tool.compensator
    async def refund(ctx: stopline.CallContext) -> str:
        refunded.append(ctx.key)
        return ctx.key

    with anyio.fail_after(30):  # a guard against the hang, not a timing
        async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}", tools=[tool]) as ledger:
            async with ledger.run("job", owner="user:1", run_id="run-1") as run:
                await run.call(tool, key="k")
            uses: dict[str, Callable[[], Awaitable[object]]] = {
                "compensate": lambda: ledger.compensate("run-1/k", by="user:1", wait=False),
                "stop": lambda: ledger.stop_compensation("run-1/k", by="user:1"),
                "review": lambda: ledger.resolve_review("run-1/k", "compensate", by="user:1"),
            }
            for what, use in uses.items():
                refused = await anyio.to_thread.run_sync(_in_another_loop, use)
                assert isinstance(refused, WrongEventLoop), (what, refused)
                assert "another thread's event loop" in str(refused), refused
            assert await ledger.backend.compensations("run-1/k") == []
            assert (await ledger.backend.events("run-1"))[-1].kind != "audit"
            corrected = await ledger.compensate("run-1/k", by="user:1", wait=True)
            assert corrected.status is stopline.OpStatus.COMPENSATED, corrected.status
        assert len(refunded) == 1
