"""`stopline runs`, `show RUN` and `cancel RUN`."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Annotated, Any

import anyio
import typer

from stopline.cli import _common as c
from stopline.cli._layout import Grid
from stopline.cli.holders import Holding, holdings
from stopline.cli.views import (
    acting_as,
    fmt_age,
    fmt_time,
    op_to_json,
    parse_age,
    run_to_json,
    shell_command,
    started_within,
    timeline,
)
from stopline.domain.limits import check_wait
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import RunState
from stopline.errors import StoplineError

__all__ = ["register"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
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
    age = None if since is None else parse_age(since)

    async def go() -> tuple[list[tuple[Any, Receipt]], dict[str, Holding]]:
        async with c.reading(url) as ledger:
            found = await ledger.runs_with_receipts(state=state, owner=owner, limit=limit)
            within = started_within(age)
            rows = [(run, receipt) for run, receipt in found if within(run)]
            return rows, await holdings(ledger.backend, [run for run, _ in rows])

    rows, held = c.run_sync(go, interrupted=c.READ_INTERRUPTED)
    if as_json:
        c.print_json(
            [
                {
                    **run_to_json(run),
                    "headline": r.headline.value,
                    "settled": r.settled,
                    "held_by": held[run.id].to_json() if run.id in held else None,
                }
                for run, r in rows
            ]
        )
        return
    if not rows:
        c.out.print("no runs match")
        return
    # the headline last: `stopline runs | awk '{print $NF}'` reads it, as it did
    table = Grid(("RUN", "NAME", "OWNER", "STATE", "PHASE", "AGE", "HELD BY", "HEADLINE"))
    for run, receipt in rows:
        table.add_row(
            run.id,
            run.name,
            run.owner,
            run.state.value,
            run.phase.value if run.phase else "",
            fmt_age(run.created_at),
            held[run.id].words() if run.id in held else "",
            receipt.headline.value,
        )
    table.print(c.out)


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
                "held": (await holdings(ledger.backend, [run])).get(run_id),
            }

    data = c.run_sync(go, interrupted=c.READ_INTERRUPTED)
    receipt: Receipt = c.cli_receipt(data["receipt"])
    if as_json:
        c.print_json(
            {
                "run": run_to_json(data["run"]),
                "operations": [op_to_json(op) for op in data["ops"]],
                "timeline": [entry.to_json() for entry in data["timeline"]],
                "receipt": receipt.to_json(),
                "held_by": None if data["held"] is None else data["held"].to_json(),
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
    if data["held"] is not None:
        c.out.print(f"held by: {data['held'].words()}")
    table = Grid(("TIME", "WHAT", "EVENT", "STATUS", "DETAIL / EVIDENCE"), title="timeline")
    for e in data["timeline"]:
        refs = ", ".join(f"{ev.kind.value}:{ev.ref}" for ev in e.evidence)
        detail = "; ".join(part for part in (e.detail, refs) if part)
        table.add_row(fmt_time(e.at, clock=True), e.subject, e.words, e.transition, detail)
    table.print(c.out)
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
    who = acting_as(by)  # before the ledger is opened: a refusal would be logged there
    waiting = c.styled("waiting for the run to settle (Ctrl-C to stop)")
    progress = None if as_json else c.err.status(waiting)
    latest: list[Receipt] = []
    sent: list[bool] = []  # the cancel went to the ledger: it may be recorded from here on
    recorded: list[bool] = []  # its fence committed: this process saw it (on_cancel)
    held: list[Holding | None] = []  # who holds the run, read when the wait gave up

    def fenced(run_ids: Sequence[str]) -> None:
        if run_id in run_ids:
            recorded.append(True)

    async def go() -> Receipt:
        async with c.opened(url) as ledger:
            ledger.on_cancel(fenced)
            sent.append(True)
            try:
                receipt = await ledger.cancel(run_id, by=who, reason=reason)
            except anyio.get_cancelled_exc_class():
                if recorded:  # Ctrl-C cut the answer of a committed cancel: read it now
                    with anyio.CancelScope(shield=True), contextlib.suppress(StoplineError):
                        latest.append(await ledger.receipt(run_id))
                raise
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
            if not receipt.settled:  # the wait gave up: what it waits on, as of now
                receipt = await ledger.receipt(run_id)
                run = await ledger.backend.get_run(run_id)
                held.append((await holdings(ledger.backend, [run])).get(run_id))
            return receipt

    def interrupted() -> int:
        if progress is not None:
            progress.stop()
        if not sent:
            c.err.print("stopline: interrupted before the cancel was sent: nothing recorded")
        elif not (latest or recorded):  # its commit may have landed with no answer (R3)
            c.err.print(
                f"stopline: interrupted before the ledger answered: the cancel may be "
                f"recorded or not. See with: stopline show {run_id} (cancelling again is safe)"
            )
        else:
            c.err.print(
                f"stopline: interrupted; the cancel is recorded in the ledger. Follow it with: "
                f"stopline show {run_id}"
            )
            if latest:
                c.emit_receipt(latest[-1], as_json)
        return c.EXIT_PENDING

    try:
        receipt = c.run_sync(go, interrupted=interrupted)
    finally:
        if progress is not None:
            progress.stop()
    c.emit_receipt(receipt, as_json)
    if held:  # said on stderr, so --json's stdout stays the receipt
        c.err.print(c.styled(f"stopline: {gave_up(receipt, timeout, held[0])}"))
    raise typer.Exit(c.exit_code_for(receipt))


def gave_up(receipt: Receipt, timeout: float, held: Holding | None) -> str:
    """What ``cancel --wait`` says when ``--timeout`` passed before the run settled:
    that it has not, what it waits on (each operation not resolved, and who holds the
    run), and how to follow it. The exit code says the same: 3, not settled yet."""
    run_id = receipt.run_id
    waiting = [line for line in receipt.lines if not line.status.resolved]
    if waiting:
        shown = "; ".join(
            f"{line.what!r} ({line.op_id}): {line.status_words}" for line in waiting[:5]
        )
        more = f"; and {len(waiting) - 5} more" if len(waiting) > 5 else ""
        n = f"{len(waiting)} operation{'s' if len(waiting) != 1 else ''}"
        on = f"it waits on {n}: {shown}{more}"
    else:
        on = f"its operations are resolved; the run is {receipt.run_state.value}"
    holder = f"; held by: {held.words()}" if held is not None else ""
    again = shell_command("cancel", [run_id], "--wait")
    return (
        f"gave up waiting after {timeout:g} s: run {run_id} has not settled yet ({on}{holder}). "
        f"The cancel is recorded and the run goes on settling: `{again}` waits again "
        f"(the same cancel), `{shell_command('show', [run_id])}` follows it"
    )


def register(app: typer.Typer) -> None:
    app.command()(runs)
    app.command()(show)
    app.command()(cancel)
