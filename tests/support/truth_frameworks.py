"""The truth matrix for a framework agent's tool: Pydantic AI, the OpenAI Agents SDK
and LangGraph.

The agent (a real one, with the framework's own offline test model) calls one
async tool, ``pay``, whose provider is ``tests/support/truth_tools.Provider``
(the same four modes as the plain-tool family). The model's first turn waits
at a barrier (``Thinking``), so "before" is a cancel while the model thinks.
A cell cancels at one point by one path:

- ``stopline-cancel``: ``s.cancel(by=...)`` (the fence, then the framework's
  own cancel: Pydantic AI's ``CancellationToken``, the SDK's
  ``RunResultStreaming.cancel``, LangGraph's task cancellation);
- ``task-cancel``: the framework's native cancel, cancelling the task that runs
  ``s.run`` / ``s.stream`` / ``g.ainvoke`` (the adapter commits the same
  stopline cancel).

The tool's read-back and canceller are given to the adapter by tool name
(``verify=``, ``cancel=``). The bare baseline runs the same agent without
stopline and cancels the task running ``agent.run`` / ``Runner.run`` /
``graph.ainvoke``; like the framework's history (a call without a return), it
takes the call as not made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Protocol

import anyio

import stopline
from stopline import Policy, RunState
from tests.conftest import FAST_VERIFY
from tests.support.truth_matrix import Cell, Row, judge, render, totals
from tests.support.truth_tools import MODES, POINTS, Provider, said_as_asked

__all__ = [
    "PATHS",
    "Family",
    "Framework",
    "Thinking",
    "bare_cells",
    "by_key",
    "check_family",
    "framework_cells",
    "run_bare",
    "run_cell",
    "tool_name",
]

PATHS = ("stopline-cancel", "task-cancel")
CANCEL_POINTS = ("before", *POINTS, "never")


def tool_name(mode: str, verifier: str) -> str:
    """The tool's name: one per mode and verifier, as the ledger knows a tool (and its
    read-back) by name."""
    return f"{mode}_{verifier}"


class Thinking:
    """The model's first turn: it says it was called, then waits to be let go."""

    def __init__(self, held: bool) -> None:
        self.called = anyio.Event()
        self.go = anyio.Event()
        if not held:
            self.go.set()

    async def __call__(self) -> None:
        self.called.set()
        await self.go.wait()


class Framework(Protocol):
    name: str

    def agent(
        self, provider: Provider, mode: str, tool: str, run_id: str, thinking: Thinking
    ) -> Any:
        """An agent whose model asks for ``tool(amount=5)`` once (call id ``c1``), then
        answers; the tool pays in ``mode`` under ``<run_id>/tool:<call id>``."""

    def session(
        self,
        ledger: stopline.Ledger,
        run_id: str,
        policy: Policy,
        settings: dict[str, Any],
    ) -> AbstractAsyncContextManager[Any]:
        """The adapter's ``sl.run(...)`` with ``settings`` (``verify=``, ``cancel=``)."""

    async def run(self, session: Any, agent: Any) -> None:
        """The agent run through the adapter."""

    async def bare(self, agent: Any) -> None:
        """The agent run without stopline."""


def by_key(provider: Provider, tool: str, verifier: str) -> dict[str, Any]:
    """The adapter's ``verify=`` and ``cancel=`` for the tool."""
    verify: dict[str, stopline.Verifier] = {}
    if verifier == "read_tool":

        async def find(ctx: stopline.CallContext) -> stopline.ReadBack:
            key = ctx.key
            # a framework tool states no horizon (R13): a read-back that says "pending"
            # while the request is at work, rather than "not found"
            if provider.pending(key):
                return stopline.ReadBack(stopline.Verdict.UNKNOWN, detail="in progress")
            found = provider.find(key)
            verdict = (
                stopline.Verdict.NOT_COMMITTED if found is None else stopline.Verdict.COMMITTED
            )
            return stopline.ReadBack(verdict, ref=f"provider:{key}", result=found)

        verify[tool] = find

    async def cancel(ctx: stopline.CallContext) -> bool:
        return await provider.cancel(ctx.key)

    return {"verify": verify, "cancel": {tool: cancel}}


def framework_cells(framework: str, full: bool) -> list[Cell]:
    """CI: every mode x every point x both paths under the default policy with a
    read-back; the immediate policy and the no-verifier column at 50 %."""
    points = CANCEL_POINTS
    if full:
        return [
            Cell(f"{framework}/{path}", m, p, policy, v)
            for path in PATHS
            for m in MODES
            for p in points
            for policy in (Policy.VERIFY, Policy.IMMEDIATE)
            for v in ("none", "read_tool")
        ]
    cells = [Cell(f"{framework}/{path}", m, p) for path in PATHS for m in MODES for p in points]
    for m in MODES:
        cells.append(Cell(f"{framework}/stopline-cancel", m, "50", Policy.IMMEDIATE))
        cells.append(Cell(f"{framework}/stopline-cancel", m, "50", verifier="none"))
    return cells


def _stops_when_asked(mode: str) -> bool:
    return mode in ("pay_cancellable", "pay_ask_only")


async def _cancel_at(
    provider: Provider,
    cell: Cell,
    key: str,
    thinking: Thinking,
    cancel: Callable[[], Awaitable[None]],
    *,
    asked: bool,
) -> None:
    """Wait for the cell's point, cancel, and let go what the cancel does not stop."""
    if cell.point == "before":
        await thinking.called.wait()
        await cancel()
        thinking.go.set()  # the model answers after the cancel: its call meets the fence
    elif cell.point in POINTS:
        await provider.reached(key, cell.point)
        await cancel()
        if not (asked and _stops_when_asked(cell.mode)):
            provider.release(key, cell.point)  # nobody asks it to stop: it goes on


async def run_cell(
    framework: Framework, ledger: stopline.Ledger, provider: Provider, cell: Cell, n: int
) -> Row:
    """One stopline cell: run the agent, cancel at the point by the path, settle, compare,
    resume the run with the same model script, compare."""
    run_id = f"{framework.name}{n}"
    key = f"{run_id}/tool:c1"
    thinking = Thinking(held=cell.point == "before")
    agent = framework.agent(
        provider, cell.mode, tool_name(cell.mode, cell.verifier), run_id, thinking
    )
    sessions: list[Any] = []
    entered = anyio.Event()
    settings = by_key(provider, tool_name(cell.mode, cell.verifier), cell.verifier)

    async def workflow() -> None:
        async with framework.session(ledger, run_id, cell.policy, settings) as s:
            sessions.append(s)
            entered.set()
            await framework.run(s, agent)

    if cell.point in POINTS:
        provider.hold(key, cell.point)
    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow)
        await entered.wait()

        async def cancel() -> None:
            if cell.transport.endswith("task-cancel"):
                tg.cancel_scope.cancel()
            else:
                await sessions[0].cancel(by="user:1")

        if cell.point != "never":
            await _cancel_at(provider, cell, key, thinking, cancel, asked=True)
    receipt = await ledger.wait_settled(run_id, timeout=60)
    truth = await provider.outcome(key)
    lines = [line for line in receipt.lines if line.op_id == key]
    claim = lines[0].status.value if lines else "nothing sent"
    verdict = judge(claim, truth)
    if cell.point in POINTS and not await said_as_asked(
        ledger, key, key in provider.cancel_requests
    ):
        verdict, claim = "FALSE", f"{claim}: asked?"  # R14: the record says what was sent
    if receipt.run_state is RunState.CANCELLED:  # R14: the resume path repeats nothing
        await ledger.resume(run_id, by="user:1")
        tool = tool_name(cell.mode, cell.verifier)
        again = framework.agent(provider, cell.mode, tool, run_id, Thinking(held=False))
        async with framework.session(ledger, run_id, cell.policy, settings) as s:
            await framework.run(s, again)
    duplicates = max(0, provider.commits(key) - 1)
    return Row(cell, "stopline", truth, claim, verdict, duplicates)


async def run_bare(framework: Framework, provider: Provider, cell: Cell, n: int) -> Row:
    """The agent without stopline, its task cancelled at the point."""
    run_id = f"{framework.name}-bare{n}"
    key = f"{run_id}/tool:c1"
    thinking = Thinking(held=cell.point == "before")
    agent = framework.agent(
        provider, cell.mode, tool_name(cell.mode, cell.verifier), run_id, thinking
    )
    if cell.point in POINTS:
        provider.hold(key, cell.point)
    async with anyio.create_task_group() as tg:
        tg.start_soon(framework.bare, agent)

        async def cancel() -> None:
            tg.cancel_scope.cancel()

        if cell.point != "never":
            await _cancel_at(provider, cell, key, thinking, cancel, asked=False)
    if cell.point in POINTS:
        await provider.ended(key)
    claim = "committed" if cell.point == "never" else "not_committed"
    truth = provider.commits(key)
    return Row(cell, "bare", truth, claim, judge(claim, truth), 0)


@dataclasses.dataclass
class Family:
    """Every cell of one framework, stopline and bare, against one provider and ledger."""

    framework: Framework
    rows: list[Row] = dataclasses.field(default_factory=list)
    bare_rows: list[Row] = dataclasses.field(default_factory=list)

    async def run(
        self, ledger: stopline.Ledger, provider: Provider, cells: list[Cell], bare: list[Cell]
    ) -> None:
        limiter = anyio.CapacityLimiter(8)

        async def one(cell: Cell, n: int) -> None:
            async with limiter:
                self.rows.append(await run_cell(self.framework, ledger, provider, cell, n))

        async def one_bare(cell: Cell, n: int) -> None:
            async with limiter:
                self.bare_rows.append(await run_bare(self.framework, provider, cell, n))

        async with anyio.create_task_group() as tg:
            for n, cell in enumerate(cells):
                tg.start_soon(one, cell, n)
            for n, cell in enumerate(bare):
                tg.start_soon(one_bare, cell, n)
        self.rows.sort(key=lambda r: r.cell.name)
        self.bare_rows.sort(key=lambda r: r.cell.name)


def bare_cells(framework: str) -> list[Cell]:
    """The bare baseline: every mode x every point, by cancelling the agent's task."""
    return [Cell(f"{framework}/bare", m, p) for m in MODES for p in CANCEL_POINTS]


async def check_family(framework: Framework, tmp_path: Path, full: bool) -> None:
    """Run the family, print its table, assert issue 20's Done-when for it."""
    cells = framework_cells(framework.name, full)
    family = Family(framework)
    async with anyio.create_task_group() as provider_tg:
        provider = Provider(provider_tg)
        url = f"sqlite:///{tmp_path / 'ledger.db'}"
        async with stopline.open(url, verify=FAST_VERIFY) as ledger:
            await family.run(ledger, provider, cells, bare_cells(framework.name))
    rows, bare_rows = family.rows, family.bare_rows
    summary: dict[str, list[Row]] = {f"bare {framework.name}: task cancel": bare_rows}
    for path in PATHS:
        summary[f"stopline {path}, default verify policy"] = [
            r for r in rows if r.cell.transport.endswith(path) and r.cell.policy is Policy.VERIFY
        ]
    summary["stopline, every cell"] = rows
    print("\n" + render([*rows, *bare_rows], summary))
    _, false_claims, duplicates = totals(rows)
    assert false_claims == 0, [r.cell.name for r in rows if r.verdict == "FALSE"]
    assert duplicates == 0, [r.cell.name for r in rows if r.duplicates]
    definite = [r for r in rows if r.cell.verifier == "read_tool"]
    assert [r.cell.name for r in definite if r.verdict != "ok"] == []
    for path in PATHS:  # each cancel path prevents at least what the bare agent does
        default = summary[f"stopline {path}, default verify policy"]
        covered = {(r.cell.mode, r.cell.point) for r in default}
        same = [r for r in bare_rows if (r.cell.mode, r.cell.point) in covered]
        assert totals(default)[0] >= totals(same)[0], path
