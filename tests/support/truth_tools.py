"""The truth matrix for a plain async tool: stopline against an in-process provider.

``Provider`` plays a remote API in this process: a request runs as the
provider's own job (in its task group, not in the caller's task), passes the
points 25, 50, 75 and 95, commits, and answers. Its ``log`` is the ground
truth. Cancelling the task that awaits the answer stops only the waiting,
except for a provider that watches its caller (``pay_cancellable``, like an
MCP server that stops on ``notifications/cancelled``). The tools:

====================  ======================================================
``pay_cancellable``   stops on a cancel request (its ``canceller``) and when
                      its caller goes away
``pay_ask_only``      stops on a cancel request only (an HTTP API with a
                      cancel endpoint: a dropped caller is not a cancel)
``pay_refusing``      has a cancel endpoint that always refuses; finishes
``pay_never``         must never be asked to cancel (no canceller); finishes
====================  ======================================================

Each is a ``@stopline.tool`` (with a read-back by key, ``find``, in the
``read_tool`` column). A cell calls the tool in a run, cancels the run while
the provider is held at one point (a barrier, never a sleep), waits for the
settled receipt, compares its line with the log, resumes the run, calls again
and counts the effects per key. The bare baseline calls the same provider
request in a plain asyncio task and cancels that task: it believes a cancelled
call did not happen.

The rows, the judgement and the table are those of the MCP matrix
(``tests/support/truth_matrix.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
from anyio.abc import TaskGroup

import stopline
from stopline import CallContext, CancelState, PhaseKind, ReadBack, RunState, Verdict
from tests.support.truth_matrix import POLICIES, VERIFIERS, Cell, Row, judge

__all__ = [
    "BARRIER_LIMIT",
    "CANCEL_POINTS",
    "MODES",
    "POINTS",
    "Provider",
    "Tools",
    "make_tool",
    "plain_cells",
    "run_bare",
    "run_cell",
    "said_as_asked",
]

POINTS = ("25", "50", "75", "95")
CANCEL_POINTS = ("before", *POINTS, "never")
MODES = ("pay_cancellable", "pay_ask_only", "pay_refusing", "pay_never")
# R13: how long after dispatch an effect may still land; the provider's jobs end as
# soon as they are released or stopped, so this only bounds a broken test
SETTLES_WITHIN = 2.0
BARRIER_LIMIT = 20.0  # a safety net for a broken test (a hold nobody releases), never a sync


class _Job:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.stop = anyio.Event()  # asked to stop (honoured by the modes that can)
        self.ended = anyio.Event()
        self.committed = False
        self.result: dict[str, Any] | None = None


class _Hold:
    def __init__(self) -> None:
        self.reached = anyio.Event()
        self.released = anyio.Event()


class Provider:
    """A remote-like provider in this process, with its ground-truth ``log``."""

    def __init__(self, tg: TaskGroup) -> None:
        self._tg = tg
        self.log: list[dict[str, Any]] = []  # {"event": "commit" | "stopped", "key", "at"}
        self.cancel_requests: list[str] = []
        self._jobs: dict[str, _Job] = {}
        self._holds: dict[tuple[str, str], _Hold] = {}

    # -- the test's barriers ---------------------------------------------------------
    def hold(self, key: str, at: str) -> None:
        self._holds[(key, at)] = _Hold()

    async def reached(self, key: str, at: str) -> None:
        with anyio.fail_after(BARRIER_LIMIT):
            await self._holds[(key, at)].reached.wait()

    def release(self, key: str, at: str) -> None:
        self._holds[(key, at)].released.set()

    async def ended(self, key: str) -> None:
        with anyio.fail_after(BARRIER_LIMIT):
            await self._jobs[key].ended.wait()

    async def outcome(self, key: str) -> int:
        """The effects of ``key`` once its request has ended: a request still held (no
        cancel stopped it) is let go first, so an effect that would land later counts."""
        job = self._jobs.get(key)
        if job is not None and not job.ended.is_set():
            for (held, _), hold in self._holds.items():
                if held == key:
                    hold.released.set()
            await self.ended(key)
        return self.commits(key)

    # -- the ground truth ----------------------------------------------------------------
    def commits(self, key: str) -> int:
        return sum(1 for e in self.log if e["event"] == "commit" and e["key"] == key)

    def pending(self, key: str) -> bool:
        """A request with this key is still at work here (the provider's status API)."""
        job = self._jobs.get(key)
        return job is not None and not job.ended.is_set()

    def find(self, key: str) -> dict[str, Any] | None:
        found = [e for e in self.log if e["event"] == "commit" and e["key"] == key]
        return found[0] if found else None

    # -- its API ---------------------------------------------------------------------------
    async def pay(self, key: str, amount: int, mode: str) -> dict[str, Any]:
        """The request: idempotent by key (a committed key answers its first result)."""
        done = self.find(key)
        if done is not None:
            return {"key": key, "amount": done["amount"], "replayed": True}
        job = self._jobs[key] = _Job(mode)
        self._tg.start_soon(self._work, key, amount, job)
        try:
            await job.ended.wait()
        except anyio.get_cancelled_exc_class():
            if mode == "pay_cancellable":  # it watches its caller: gone is a cancel
                job.stop.set()
            raise
        if job.result is None:
            raise stopline.Rejected("cancelled at the provider", ref=f"provider:{key}")
        return job.result

    async def cancel(self, key: str) -> bool:
        """The cancel endpoint: True once the request stopped with no effect."""
        self.cancel_requests.append(key)
        job = self._jobs.get(key)
        if job is None or job.mode == "pay_refusing":
            return False
        job.stop.set()
        await job.ended.wait()
        return not job.committed

    async def _work(self, key: str, amount: int, job: _Job) -> None:
        try:
            for at in POINTS:
                hold = self._holds.get((key, at))
                if hold is not None and not hold.reached.is_set():  # one-shot: the next call
                    hold.reached.set()
                    with anyio.move_on_after(BARRIER_LIMIT):
                        async with anyio.create_task_group() as tg:

                            async def first(event: anyio.Event, scope: anyio.CancelScope) -> None:
                                await event.wait()
                                scope.cancel()

                            tg.start_soon(first, hold.released, tg.cancel_scope)
                            if job.mode in ("pay_cancellable", "pay_ask_only"):
                                tg.start_soon(first, job.stop, tg.cancel_scope)
                if job.stop.is_set() and job.mode in ("pay_cancellable", "pay_ask_only"):
                    self.log.append({"event": "stopped", "key": key, "at": at})
                    return
            self.log.append({"event": "commit", "key": key, "at": "commit", "amount": amount})
            job.committed = True
            job.result = {"key": key, "amount": amount}
        finally:
            job.ended.set()


def make_tool(provider: Provider, mode: str, verifier: str) -> stopline.Tool[dict[str, Any]]:
    """The tool of ``mode``, with the read-back by key when ``verifier`` is ``read_tool``."""

    @stopline.tool(name=f"{mode}-{verifier}", settles_within=SETTLES_WITHIN)
    async def pay(ctx: CallContext, amount: int) -> dict[str, Any]:
        return await provider.pay(ctx.key, amount, mode)

    if mode != "pay_never":

        @pay.canceller
        async def cancel(ctx: CallContext) -> bool:
            return await provider.cancel(ctx.key)

    if verifier == "read_tool":

        @pay.verifier
        async def find(ctx: CallContext) -> ReadBack:
            found = provider.find(ctx.key)
            if found is None:  # "not found"; the runtime decides what it proves (R13)
                return ReadBack(Verdict.NOT_COMMITTED, ref=f"provider:{ctx.key}")
            return ReadBack(Verdict.COMMITTED, ref=f"provider:{ctx.key}", result=found)

    return pay


def plain_cells(full: bool) -> list[Cell]:
    """CI: every mode x every point under the default policy with a read-back, every
    policy and the no-verifier column at 50 %. Full: the whole cross-product."""
    if full:
        return [
            Cell("plain", m, p, policy, v)
            for m in MODES
            for p in CANCEL_POINTS
            for policy in POLICIES
            for v in VERIFIERS
        ]
    cells = [Cell("plain", m, p) for m in MODES for p in CANCEL_POINTS]
    for m in MODES:
        cells += [Cell("plain", m, "50", policy) for policy in POLICIES[1:]]
        cells.append(Cell("plain", m, "50", verifier="none"))
    return cells


@dataclasses.dataclass
class Tools:
    provider: Provider
    made: dict[tuple[str, str], stopline.Tool[dict[str, Any]]] = dataclasses.field(
        default_factory=dict
    )

    def __call__(self, mode: str, verifier: str) -> stopline.Tool[dict[str, Any]]:
        if (mode, verifier) not in self.made:
            self.made[(mode, verifier)] = make_tool(self.provider, mode, verifier)
        return self.made[(mode, verifier)]


def _stops_when_asked(mode: str) -> bool:
    return mode in ("pay_cancellable", "pay_ask_only")


async def run_cell(ledger: stopline.Ledger, tools: Tools, cell: Cell, n: int) -> Row:
    """One stopline cell: call, cancel at the point, settle, compare, resume, compare."""
    provider = tools.provider
    tool = tools(cell.mode, cell.verifier)
    run_id = f"pt{n}"
    key = f"{run_id}/pay"
    point = cell.point if cell.point in POINTS else ""

    async def workflow() -> None:
        async with (
            ledger.run("pay", owner="user:1", run_id=run_id) as run,
            run.phase(PhaseKind.CALLING_EXTERNAL, cell.policy),
        ):
            if cell.point == "before":
                await ledger.cancel(run.id, by="user:1")
            await run.call(tool, 5, key="pay")

    if point:
        provider.hold(key, point)
    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow)
        if point:
            await provider.reached(key, point)
            await ledger.cancel(run_id, by="user:1")
            if not _stops_when_asked(cell.mode):  # it goes on whatever: let it
                provider.release(key, point)
    receipt = await ledger.wait_settled(run_id, timeout=60)
    truth = await provider.outcome(key)
    claim = receipt.lines[0].status.value if receipt.lines else "nothing sent"
    verdict = judge(claim, truth)
    if point and not await said_as_asked(ledger, key, key in provider.cancel_requests):
        verdict, claim = "FALSE", f"{claim}: asked?"  # R14: the record says what was sent
    if receipt.run_state is RunState.CANCELLED:  # R14: the resume path repeats nothing
        await ledger.resume(run_id, by="user:1")
        async with ledger.run("pay", owner="user:1", run_id=run_id) as run:
            await run.call(tool, 5, key="pay")
    duplicates = max(0, provider.commits(key) - 1)
    return Row(cell, "stopline", truth, claim, verdict, duplicates)


ASKED = (CancelState.ASKED, CancelState.CONFIRMED, CancelState.REFUSED, CancelState.UNANSWERED)


async def said_as_asked(ledger: stopline.Ledger, op_id: str, asked: bool) -> bool:
    """R14: the operation's record says its provider was asked to cancel iff it was."""
    op = await ledger.backend.get_operation(op_id)
    return (op.cancel_state in ASKED) == asked


async def run_bare(provider: Provider, cell: Cell, n: int) -> Row:
    """The same request in a plain asyncio task, cancelled by cancelling that task; the
    caller takes a cancelled call to mean nothing happened."""
    key = f"bare{n}"
    point = cell.point if cell.point in POINTS else ""
    claim = "not_committed"
    if cell.point == "never":
        await provider.pay(key, 5, cell.mode)
        claim = "committed"
    elif point:
        provider.hold(key, point)
        async with anyio.create_task_group() as tg:
            tg.start_soon(provider.pay, key, 5, cell.mode)
            await provider.reached(key, point)
            tg.cancel_scope.cancel()
        provider.release(key, point)  # nobody asked it to stop: it goes on
        await provider.ended(key)
    truth = provider.commits(key)
    return Row(cell, "bare", truth, claim, judge(claim, truth), 0)
