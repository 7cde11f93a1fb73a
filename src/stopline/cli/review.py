"""`stopline review list | show OP | resolve OP`: the operations a human must decide."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from stopline.cli import _common as c
from stopline.cli._layout import Grid
from stopline.cli.views import (
    acting_as,
    check_note,
    decide,
    event_to_json,
    fmt_time,
    op_to_json,
    review_item_json,
    run_to_json,
)
from stopline.cli.views import timeline as build_timeline
from stopline.domain.guidance import correct_in_application, review_step
from stopline.domain.model import Evidence, horizon_in
from stopline.domain.receipt import Receipt, horizon_words
from stopline.errors import NotPermitted
from stopline.runtime.review import REVIEW_STATUSES, ReviewVerdict

__all__ = ["app"]

app = typer.Typer(
    help="The review queue: outcomes that need a human decision.", no_args_is_help=True
)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
OpArg = Annotated[str, typer.Argument(help="The operation id.", metavar="OP")]


@app.command("list")
def list_(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Operations in needs_review (or whose correction failed), with their run."""
    url = c.options(ctx).url

    async def go() -> list[Any]:
        async with c.reading(url) as ledger:
            return await ledger.review_items()

    items = c.run_sync(go, interrupted=c.READ_INTERRUPTED)
    if as_json:
        c.print_json([review_item_json(item) for item in items])
        return
    if not items:
        c.out.print("the review queue is empty")
        return
    table = Grid(("OPERATION", "WHAT", "STATUS", "RUN", "OWNER", "SINCE", "LAST EVIDENCE"))
    for item in items:
        last = item.op.evidence[-1] if item.op.evidence else None
        table.add_row(
            item.op.id,
            item.op.description or item.op.tool,
            item.op.status.value,
            item.run.id,
            item.run.owner,
            fmt_time(item.op.updated_at),
            f"{last.kind.value}:{last.ref} {last.detail}".strip() if last else "",
        )
    table.print(c.out)


@app.command()
def show(ctx: typer.Context, op_id: OpArg, as_json: JsonOpt = False) -> None:
    """One operation with its run, every event and all its evidence."""
    url = c.options(ctx).url

    async def go() -> dict[str, Any]:
        async with c.reading(url) as ledger:
            op = await ledger.backend.get_operation(op_id)
            run = await ledger.backend.get_run(op.run_id)
            events = [e for e in await ledger.backend.events(op.run_id) if e.op_id == op_id]
            return {"op": op, "run": run, "events": events}

    data = c.run_sync(go, interrupted=c.READ_INTERRUPTED)
    op, run, events = data["op"], data["run"], data["events"]
    if as_json:
        c.print_json(
            {
                "operation": op_to_json(op),
                "run": run_to_json(run),
                "events": [event_to_json(e) for e in events],
            }
        )
        return
    c.out.print(c.styled((op.description or op.tool, "bold"), f" {op.id}"))
    c.out.print(f"  status {op.status.value}; run {run.id} ({run.state.value}), owner {run.owner}")
    c.out.print(
        f"  cancel ability on record: {op.cancellable.value}; verifier: {op.can_verify}; "
        f"compensator: {op.can_compensate}; attempts: {op.attempts}"
    )
    if op.error:
        c.out.print(f"  error: {op.error}")
    if op.status in REVIEW_STATUSES:  # what the ledger takes now (R13: not before its horizon)
        c.out.print(f"  decide: {decide(review_step(run.id, [op]))}")
    c.out.print("evidence", style="bold")
    for ev in op.evidence:
        c.out.print(f"  - {ev.kind.value}: {ev.ref} {_evidence_detail(ev)}".rstrip())
    c.out.print("events", style="bold")
    for entry in build_timeline(events, [op]):
        line = f"  {entry.seq} {fmt_time(entry.at)} {entry.words}"
        if entry.transition:
            line += f" [{entry.transition}]"
        if entry.detail:
            line += f" ({entry.detail})"
        c.out.print(line)


@app.command()
def resolve(
    ctx: typer.Context,
    op_id: OpArg,
    decision: Annotated[
        ReviewVerdict,
        typer.Option(
            "--as",
            help="What the reviewer found: it happened (committed), it did not "
            "(not_committed), or it happened and must be corrected (compensate).",
            case_sensitive=False,
        ),
    ],
    note: Annotated[str, typer.Option(help="What the decision rests on (evidence).")] = "",
    by: Annotated[
        str, typer.Option(help="The reviewer; recorded in the ledger.", envvar="STOPLINE_PRINCIPAL")
    ] = "cli:operator",
    as_json: JsonOpt = False,
) -> None:
    """Record a reviewer's decision on an operation in needs_review; prints the run's receipt.

    Exit code as for cancel: 0 settled, 3 still settling (a correction), 4 still in review.
    `compensate` runs the tool's compensator, which is the application's code: from a
    shell it is refused, nothing recorded, with what to do instead.
    """
    url = c.options(ctx).url
    who = acting_as(by)  # before the ledger is opened: a refusal would be logged there
    check_note(note)  # kept whole, or refused here: the ledger would cut it silently

    async def go() -> Receipt:
        if decision is ReviewVerdict.COMPENSATE:
            async with c.reading(url) as reader:  # refused before anything is written
                op = await reader.backend.get_operation(op_id)
            if op.can_compensate and op.compensates is None:  # else the ledger says why not
                raise NotPermitted(_compensate_elsewhere(op_id, op.tool))
        async with c.opened(url) as ledger:
            return await ledger.resolve_review(op_id, decision, by=who, note=note)

    receipt = c.run_sync(
        go,
        interrupted="interrupted before the ledger answered: the decision may be recorded or "
        f"not. See with: stopline review show {op_id} (a decision recorded already is not "
        "recorded again: the operation is no longer in review)",
    )
    c.emit_receipt(receipt, as_json)
    raise typer.Exit(c.exit_code_for(receipt))


def _evidence_detail(ev: Evidence) -> str:
    """An item's detail; a horizon's (epoch seconds) with the time it names."""
    at = horizon_in([ev])
    return ev.detail if at is None else f"{horizon_words(at)} ({ev.detail})"


def _compensate_elsewhere(op_id: str, tool: str) -> str:
    """What to do instead of ``--as compensate`` from a shell (``correct_in_application``)."""
    here = f"run `stopline review resolve {op_id} --as committed` here"
    return (
        f"operation {op_id!r}: nothing was recorded; "
        f"{correct_in_application(op_id, tool, here=here)}, in a process opened with the "
        "tool (stopline.open(url, tools=[...]))"
    )
