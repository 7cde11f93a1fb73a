"""`stopline stats`: outcomes by headline, cancel-to-settled time, how unknowns resolved.

Everything is computed from the ledger's append-only event log, so the
figures hold for runs of every process that wrote to the ledger. The same
figures are emitted live as OpenTelemetry metrics by ``stopline.telemetry``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import Annotated, Any

import typer

from stopline.cli import _common as c
from stopline.cli._layout import Grid
from stopline.cli.views import fmt_seconds, parse_age, started_within
from stopline.domain.model import EventRecord
from stopline.domain.vocab import OpEvent, OpStatus, RunEvent
from stopline.runtime.ledger import Ledger
from stopline.telemetry import resolved_by

__all__ = ["Stats", "compute_stats", "percentile", "register"]

_SETTLED_KINDS = frozenset({RunEvent.SETTLED, RunEvent.ESCALATE})
_DECIDED = frozenset({OpStatus.COMMITTED.value, OpStatus.NOT_COMMITTED.value})
_DOUBT = frozenset({OpStatus.UNKNOWN.value, OpStatus.NEEDS_REVIEW.value})


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclasses.dataclass(slots=True)
class Stats:
    runs: int = 0
    outcomes: Counter[str] = dataclasses.field(default_factory=Counter)
    cancelled: int = 0
    settle_times: list[float] = dataclasses.field(default_factory=list)
    unknowns: int = 0
    resolved: Counter[str] = dataclasses.field(default_factory=Counter)
    # workers holding operations in flight whose lease lapsed: their background work
    # (lease renewal first) is failing, or they died and recovery has yet to run
    degraded: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def share(self, how: str) -> float | None:
        return self.resolved[how] / self.unknowns if self.unknowns else None

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "outcomes": dict(self.outcomes.most_common()),
            "cancelled_runs": self.cancelled,
            "cancel_to_settled": {
                "settled": len(self.settle_times),
                "p50_seconds": percentile(self.settle_times, 50),
                "p99_seconds": percentile(self.settle_times, 99),
            },
            "unknowns": {
                "total": self.unknowns,
                "resolved_by": dict(self.resolved),
                "share_read_back": self.share("read_back"),
                "share_review": self.share("review"),
            },
            "degraded": self.degraded,
        }


def _settle_time(events: Sequence[EventRecord]) -> float | None:
    start = next((e.at for e in events if e.kind == RunEvent.CANCEL), None)
    if start is None:
        return None
    end = next((e.at for e in events if e.kind in _SETTLED_KINDS and e.at >= start), None)
    return None if end is None else max(0.0, end - start)


def _unknowns(events: Sequence[EventRecord]) -> tuple[int, Counter[str]]:
    """Operations that were unknown at some point, and what settled each."""
    doubted: dict[str, str] = {}  # op id -> how it was resolved ("unresolved" until then)
    for e in events:
        if e.op_id is None:
            continue
        if e.to_state == OpStatus.UNKNOWN.value:
            doubted.setdefault(e.op_id, "unresolved")
        elif e.op_id in doubted and e.from_state in _DOUBT and e.to_state in _DECIDED:
            try:
                doubted[e.op_id] = resolved_by(OpEvent(e.kind))
            except ValueError:
                doubted[e.op_id] = e.kind
    return len(doubted), Counter(doubted.values())


async def compute_stats(
    ledger: Ledger, *, since: float | None = None, limit: int = 10_000
) -> Stats:
    """The figures of the ``limit`` newest runs started within ``since`` seconds.

    Each run counts under its receipt's headline, read as ``ledger.receipt`` reads it
    (the run's operations and those of the runs it owns exclusively), so a parent
    whose child committed an action is not counted as cancelled before any action.
    """
    stats = Stats()
    backend = ledger.backend
    within = started_within(since)
    for run, receipt in await ledger.runs_with_receipts(limit=limit):
        if not within(run):
            continue
        events = await backend.events(run.id)
        stats.runs += 1
        stats.outcomes[receipt.headline.value] += 1
        if run.cancelled_at is not None:
            stats.cancelled += 1
        took = _settle_time(events)
        if took is not None:
            stats.settle_times.append(took)
        total, how = _unknowns(events)
        stats.unknowns += total
        stats.resolved.update(how)
    now = time.time()
    stats.degraded = [
        {
            "worker": w.worker,
            "host": w.host,
            "pid": w.pid,
            "lapsed_s": round(now - w.lease_until, 1),
            "in_flight": w.in_flight,
        }
        for w in await backend.in_flight_workers()
        if w.lease_until is not None and w.lease_until < now
    ]
    return stats


def _fmt_share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def stats(
    ctx: typer.Context,
    since: Annotated[
        str | None, typer.Option(help="Only runs started within this age: 1h, 2d, ...")
    ] = None,
    limit: Annotated[
        int, typer.Option(help="At most this many runs, newest first.", min=0)
    ] = 10_000,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Outcomes by headline, time from cancel to settled (p50/p99), how unknowns resolved."""
    url = c.options(ctx).url
    age = None if since is None else parse_age(since)

    async def go() -> Stats:
        async with c.reading(url) as ledger:
            return await compute_stats(ledger, since=age, limit=limit)

    result = c.run_sync(go, interrupted=c.READ_INTERRUPTED)
    if as_json:
        c.print_json(result.to_json())
        return
    outcomes = Grid(("HEADLINE", "RUNS"), title="outcomes", right=frozenset({"RUNS"}))
    for headline, count in result.outcomes.most_common():
        outcomes.add_row(headline, str(count))
    c.out.print(f"{result.runs} runs, {result.cancelled} cancelled")
    outcomes.print(c.out)
    c.out.print(
        f"cancel -> settled: {len(result.settle_times)} runs, "
        f"p50 {fmt_seconds(percentile(result.settle_times, 50))}, "
        f"p99 {fmt_seconds(percentile(result.settle_times, 99))}"
    )
    c.out.print(
        f"unknown outcomes: {result.unknowns}; resolved by read-back "
        f"{_fmt_share(result.share('read_back'))}, by review {_fmt_share(result.share('review'))}"
        + "".join(
            f", {how.replace('_', ' ')} {n}"
            for how, n in sorted(result.resolved.items())
            if how not in ("read_back", "review")
        )
    )
    c.out.print(
        "degraded: "
        + (
            "; ".join(
                f"worker {w['worker']} (pid {w['pid']}) lease lapsed {w['lapsed_s']} s ago "
                f"with {w['in_flight']} operation(s) in flight"
                for w in result.degraded
            )
            or "no"
        )
    )


def register(app: typer.Typer) -> None:
    app.command()(stats)
