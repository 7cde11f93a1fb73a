"""The truth matrix: stopline against a server that knows nothing of it.

Each cell calls one tool of tests/support/thirdparty_mcp_server.py through
``StoplineMCP``, cancels the run at one point of the call (before dispatch,
at 25/50/75/95 % of it, or never) under one phase policy, with one verifier
(none; the server's found/not-found read tool mapped to a verifier; or, on the
same server built with stopline's server-side helpers, its ``stopline_verify``
read-back), waits
for the settled receipt, compares every line with the server's own
ground-truth log, then resumes the run and checks that nothing happened twice.

A line agrees with the truth when it says what happened (committed: the log
has the effect; not committed or prevented: it has none) or says it does not
know (unknown, needs_review). A line that says otherwise is a false claim.

The same cells run through the bare ``mcp`` SDK client, which cancels by
cancelling the awaiting scope and then believes the call did not happen: its
row is the baseline for "effects prevented".

Cancel points are barriers held by the server (``ctl_hold``), never sleeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

import stopline
from mcp import Client
from stopline import CallContext, OpStatus, PhaseKind, Policy, ReadBack, RunState, Verdict
from stopline.integrations.mcp import StoplineMCP, ToolPolicy
from tests.support.thirdparty_mcp_server import EFFECT_TOOLS, POINTS, commits

TRANSPORTS = ("stdio-legacy", "stdio-2026", "http-legacy", "http-2026")
CANCEL_POINTS = ("before", *POINTS, "never")
POLICIES = (Policy.VERIFY, Policy.AT_BOUNDARY, Policy.IMMEDIATE)
VERIFIERS = ("none", "read_tool", "stopline_verify")
# R13: how long after dispatch each tool's effect may still land. The cancellable
# tool stops on a cancel (held at a barrier, it cannot run past it); the others
# finish once released, well within their bound.
SETTLES_WITHIN = {
    "pay_cancellable": 1.0,
    "pay_uncancellable": 20.0,
    "pay_sync": 20.0,
    "pay_late": 20.0,
}


@dataclasses.dataclass(frozen=True, slots=True)
class Cell:
    transport: str
    mode: str  # the tool
    point: str  # where the cancel lands: before, 25 ... 95, never
    policy: Policy = Policy.VERIFY
    verifier: str = "read_tool"

    @property
    def name(self) -> str:
        return f"{self.transport}/{self.mode}/{self.point}/{self.policy.value}/{self.verifier}"


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    cell: Cell
    client: str  # "stopline" or "bare-sdk"
    truth: int  # effects the server really made for the cell's key
    claim: str  # what the client's record says
    verdict: str  # "ok" (equals the truth), "review" (says it does not know), "FALSE"
    duplicates: int  # effects beyond one after resume

    @property
    def prevented(self) -> bool:
        return self.cell.point != "never" and self.truth == 0


def judge(claim: str, truth: int) -> str:
    if claim in (OpStatus.UNKNOWN.value, OpStatus.NEEDS_REVIEW.value):
        return "review"
    said_happened = claim in (OpStatus.COMMITTED.value, "completed")
    return "ok" if said_happened == (truth > 0) else "FALSE"


def subset() -> list[Cell]:
    """CI's share: every mode x every cancel point on stdio (2025 era) under the default
    policy with a read tool; every policy and the no-verifier column at 50 %; a
    diagonal over the other transports and eras."""
    cells = [Cell("stdio-legacy", m, p) for m in EFFECT_TOOLS for p in CANCEL_POINTS]
    for m in EFFECT_TOOLS:
        cells += [Cell("stdio-legacy", m, "50", policy) for policy in POLICIES[1:]]
        cells.append(Cell("stdio-legacy", m, "50", verifier="none"))
    for i, transport in enumerate(TRANSPORTS[1:]):
        for j, m in enumerate(EFFECT_TOOLS):
            point = CANCEL_POINTS[1 + (i + j) % len(POINTS)]
            cells.append(Cell(transport, m, point, POLICIES[(i + j) % len(POLICIES)]))
    # the server-side stopline read-back: every mode at two points, and two other transports
    cells += [
        Cell("stdio-legacy", m, p, verifier="stopline_verify")
        for m in EFFECT_TOOLS
        for p in ("50", "95")
    ]
    cells += [
        # a cut on 2026 HTTP: the shielded tool is slowed by its closed stream, its
        # record says "in progress" past the read-back budget (the read long-polls)
        Cell("http-2026", "pay_late", "25", Policy.IMMEDIATE, "stopline_verify"),
        Cell("stdio-2026", "pay_uncancellable", "25", Policy.IMMEDIATE, "stopline_verify"),
    ]
    return cells


def full() -> list[Cell]:
    return [
        Cell(t, m, p, policy, v)
        for t in TRANSPORTS
        for m in EFFECT_TOOLS
        for p in CANCEL_POINTS
        for policy in POLICIES
        for v in VERIFIERS
    ]


def baseline_cells(cells: Sequence[Cell]) -> list[Cell]:
    """One bare-SDK cell per (transport, mode, point) the stopline cells cover."""
    seen = {(c.transport, c.mode, c.point) for c in cells}
    return [Cell(t, m, p) for t, m, p in sorted(seen)]


# -- one connection per transport and era, shared by its cells --------------------------
def verifier_for(conn: StoplineMCP) -> Any:
    """The right verifier for a third-party server: map its read tool (found/not found).
    "Not found" is reported as such; the runtime decides when it proves anything (R13)."""

    async def find(ctx: CallContext) -> ReadBack:
        result = await conn.client.call_tool("find_payment", {"idempotency_key": ctx.key})
        if result.is_error or not isinstance(result.structured_content, dict):
            return ReadBack(Verdict.UNKNOWN, detail="find_payment failed")
        found = result.structured_content
        if found["found"]:
            return ReadBack(
                Verdict.COMMITTED, ref=f"find_payment:{ctx.key}", result=found["payment"]
            )
        return ReadBack(Verdict.NOT_COMMITTED, ref=f"find_payment:{ctx.key}")

    return find


def policies() -> dict[str, ToolPolicy]:
    return {
        m: ToolPolicy(key_argument="idempotency_key", settles_within=SETTLES_WITHIN[m])
        for m in EFFECT_TOOLS
    }


async def ctl(client: Client, name: str, **arguments: Any) -> Any:
    result = await client.call_tool(name, arguments)
    assert not result.is_error, result
    return result.structured_content


async def run_cell(
    ledger: stopline.Ledger, conns: dict[str, StoplineMCP], log: Path, cell: Cell, n: int
) -> Row:
    """One stopline cell: call, cancel at the point, settle, compare, resume, compare."""
    conn = conns[f"{cell.transport}/{cell.verifier}"]
    run_id = f"tm{n}"
    key = f"{run_id}/pay"
    tool = cell.mode
    go = anyio.Event()

    async def body(run: stopline.Run) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, cell.policy):
            if cell.point == "before":
                await ledger.cancel(run.id, by="user:1")
            await conn.call(run, tool, {"amount": 5}, key="pay")

    async def workflow() -> None:
        async with ledger.run("pay", owner="user:1", run_id=run_id) as run:
            await go.wait()
            await body(run)

    point = cell.point if cell.point in POINTS else ""
    if point:
        await ctl(conn.client, "ctl_hold", tool=tool, at=point, idempotency_key=key)
    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow)
        go.set()
        if point:
            await ctl(conn.client, "ctl_reached", tool=tool, at=point, idempotency_key=key)
            await ledger.cancel(run_id, by="user:1")
            if tool != "pay_cancellable":
                await ctl(conn.client, "ctl_release", tool=tool, at=point, idempotency_key=key)
    receipt = await ledger.wait_settled(run_id, timeout=60)
    truth = len(commits(log, key))
    claim = receipt.lines[0].status.value if receipt.lines else "nothing sent"
    if cell.point == "never":
        claim = receipt.lines[0].status.value
    verdict = judge(claim, truth)
    if receipt.run_state is RunState.CANCELLED:  # R14: the receipt's resume path repeats nothing
        await ledger.resume(run_id, by="user:1")
        async with ledger.run("pay", owner="user:1", run_id=run_id) as run:
            await conn.call(run, tool, {"amount": 5}, key="pay")
    duplicates = max(0, len(commits(log, key)) - 1)
    return Row(cell, "stopline", truth, claim, verdict, duplicates)


async def run_bare(client: Client, log: Path, cell: Cell, n: int) -> Row:
    """The bare SDK client: it cancels its call and takes that to mean nothing happened."""
    key = f"bare{n}"
    tool = cell.mode
    point = cell.point if cell.point in POINTS else ""
    claim = "not_committed"
    if cell.point == "before":
        pass  # a cancel before the call: it is never made
    elif not point:
        await client.call_tool(tool, {"idempotency_key": key, "amount": 5})
        claim = "committed"
    else:
        await ctl(client, "ctl_hold", tool=tool, at=point, idempotency_key=key)
        async with anyio.create_task_group() as tg:

            async def call() -> None:
                await client.call_tool(tool, {"idempotency_key": key, "amount": 5})

            tg.start_soon(call)
            await ctl(client, "ctl_reached", tool=tool, at=point, idempotency_key=key)
            tg.cancel_scope.cancel()
        if tool != "pay_cancellable":
            await ctl(client, "ctl_release", tool=tool, at=point, idempotency_key=key)
        await ctl(client, "ctl_ended", idempotency_key=key)
    truth = len(commits(log, key))
    return Row(cell, "bare-sdk", truth, claim, judge(claim, truth), 0)


def totals(rows: Sequence[Row]) -> tuple[int, int, int]:
    """(effects prevented, false claims, duplicates after resume)."""
    return (
        sum(r.prevented for r in rows),
        sum(r.verdict == "FALSE" for r in rows),
        sum(r.duplicates for r in rows),
    )


def render(rows: Sequence[Row], summary: Mapping[str, Sequence[Row]]) -> str:
    out = [f"{'cell':<70} {'client':<9} {'truth':>5}  {'claim':<14} {'verdict':<7} dup"]
    for r in rows:
        out.append(
            f"{r.cell.name:<70} {r.client:<9} {r.truth:>5}  {r.claim:<14} {r.verdict:<7} "
            f"{r.duplicates}"
        )
    out.append("")
    out.append("| client | cells | effects prevented | false claims | duplicates after resume |")
    out.append("| --- | --- | --- | --- | --- |")
    for name, group in summary.items():
        prevented, false, dups = totals(group)
        out.append(f"| {name} | {len(group)} | {prevented} | {false} | {dups} |")
    return "\n".join(out)
