"""`stopline runs`, `show RUN` and `cancel RUN`."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
import typer
from rich.table import Table

from stopline.cli import _common as c
from stopline.cli.views import (
    fmt_age,
    fmt_time,
    op_to_json,
    parse_age,
    run_to_json,
    started_within,
    timeline,
)
from stopline.domain.lifecycle import operator
from stopline.domain.limits import check_wait
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import RunState

__all__ = ["register"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
RunArg = Annotated[str, typer.Argument(help="The run id.", metavar="RUN")]


def runs(
    ctx: typer.Context,
    state: Annotated[
        RunState | None, typer.Option(help="Only runs in this state.", case_sensitive=False)
    ] = None,
    owner: Annotated[str | None, typer.Option(help="Only runs of this owner.")] = None,
    since: Annotated[
        str | None, typer.Option(help="Only runs started within this age: 90s, 15m, 1h, 2d, 1w.")
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many runs, newest first.", min=0)] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List runs, newest first, with their state and receipt headline."""
    url = c.options(ctx).url
    age = parse_age(since) if since else None

    async def go() -> list[tuple[Any, Receipt]]:
        async with c.reading(url) as ledger:
            found = await ledger.runs_with_receipts(state=state, owner=owner, limit=limit)
            within = started_within(age)
            return [(run, receipt) for run, receipt in found if within(run)]

    rows = c.run_sync(go)
    if as_json:
        c.print_json(
            [
                {**run_to_json(run), "headline": r.headline.value, "settled": r.settled}
                for run, r in rows
            ]
        )
        return
    if not rows:
        c.out.print("no runs match")
        return
    table = Table(box=None, header_style="bold")
    table.add_column("RUN", no_wrap=True)
    for name in ("NAME", "OWNER", "STATE", "PHASE", "AGE", "HEADLINE"):
        table.add_column(name, overflow="fold")
    for run, receipt in rows:
        table.add_row(
            run.id,
            run.name,
            run.owner,
            run.state.value,
            run.phase.value if run.phase else "",
            fmt_age(run.created_at),
            receipt.headline.value,
        )
    c.out.print(table)


def show(ctx: typer.Context, run_id: RunArg, as_json: JsonOpt = False) -> None:
    """A run's timeline (phases, operations, cancel, evidence) and its receipt."""
    url = c.options(ctx).url

    async def go() -> dict[str, Any]:
        async with c.reading(url) as ledger:
            run = await ledger.backend.get_run(run_id)
            ops = await ledger.backend.operations(run_id)
            events = await ledger.backend.events(run_id)
            return {
                "run": run,
                "ops": ops,
                "timeline": timeline(events, ops),
                "receipt": await ledger.receipt(run_id),
            }

    data = c.run_sync(go)
    receipt: Receipt = data["receipt"]
    if as_json:
        c.print_json(
            {
                "run": run_to_json(data["run"]),
                "operations": [op_to_json(op) for op in data["ops"]],
                "timeline": [entry.to_json() for entry in data["timeline"]],
                "receipt": receipt.to_json(),
            }
        )
        return
    run = data["run"]
    c.out.print(
        c.styled(
            (run.name, "bold"),
            f" {run.id}  owner {run.owner}  tenant {run.tenant}  state ",
            (run.state.value, "bold"),
        )
    )
    table = Table(box=None, header_style="bold", title="timeline", title_justify="left")
    table.add_column("TIME", no_wrap=True)
    for name in ("WHAT", "EVENT", "STATUS", "DETAIL / EVIDENCE"):
        table.add_column(name, overflow="fold")
    for e in data["timeline"]:
        refs = ", ".join(f"{ev.kind.value}:{ev.ref}" for ev in e.evidence)
        detail = "; ".join(part for part in (e.detail, refs) if part)
        table.add_row(fmt_time(e.at, clock=True), e.subject, e.words, e.transition, detail)
    c.out.print(table)
    c.out.print()
    c.out.print("receipt", style="bold")
    c.print_receipt(receipt)


def cancel(
    ctx: typer.Context,
    run_id: RunArg,
    reason: Annotated[str, typer.Option(help="Why; recorded in the ledger.")] = "",
    by: Annotated[
        str, typer.Option(help="Who asks; recorded in the ledger.", envvar="STOPLINE_PRINCIPAL")
    ] = "cli:operator",
    wait: Annotated[bool, typer.Option(help="Wait until the receipt is settled.")] = False,
    timeout: Annotated[float, typer.Option(help="With --wait: give up after N seconds.")] = 60.0,
    as_json: JsonOpt = False,
) -> None:
    """Cancel a run: the fence is committed first, then the receipt is shown.

    Exit code: 0 settled, 3 still verifying or awaiting confirmation, 4 needs review.
    """
    url = c.options(ctx).url
    check_wait("--timeout", timeout)  # before the cancel: nan failed once it was recorded
    waiting = c.styled("waiting for the run to settle (Ctrl-C to stop)")
    progress = None if as_json else c.err.status(waiting)
    latest: list[Receipt] = []
    sent: list[bool] = []  # the cancel went to the ledger: it may be recorded from here on

    async def go() -> Receipt:
        async with c.opened(url) as ledger:
            sent.append(True)
            receipt = await ledger.cancel(run_id, by=operator(by), reason=reason)
            latest.append(receipt)
            if not wait or receipt.settled:
                return receipt
            if progress is not None:
                progress.start()
            with anyio.move_on_after(timeout):
                while True:
                    receipt = await ledger.receipt(run_id)
                    latest.append(receipt)
                    if progress is not None:
                        progress.update(c.styled(f"{receipt.message} (Ctrl-C to stop waiting)"))
                    if receipt.settled:
                        break
                    await ledger.wait_for_change(run_id)
            return receipt

    try:
        receipt = c.run_sync(go)
    except KeyboardInterrupt:
        if progress is not None:
            progress.stop()
        if not sent:
            c.fail("interrupted before the cancel was sent: nothing recorded", c.EXIT_PENDING)
        if not latest:  # its commit may have landed with no answer back (R3's rule)
            c.fail(
                f"interrupted before the ledger answered: the cancel may be recorded or not. "
                f"See with: stopline show {run_id} (cancelling again is safe)",
                c.EXIT_PENDING,
            )
        c.err.print(
            f"interrupted; the cancel is recorded in the ledger. Follow it with: stopline show "
            f"{run_id}"
        )
        receipt = latest[-1]
        _emit(receipt, as_json)
        raise typer.Exit(c.EXIT_PENDING) from None
    finally:
        if progress is not None:
            progress.stop()
    _emit(receipt, as_json)
    raise typer.Exit(c.exit_code_for(receipt))


def _emit(receipt: Receipt, as_json: bool) -> None:
    if as_json:
        c.print_json(receipt.to_json())
    else:
        c.print_receipt(receipt)


def register(app: typer.Typer) -> None:
    app.command()(runs)
    app.command()(show)
    app.command()(cancel)
