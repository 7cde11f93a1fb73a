"""`stopline pause`, `resume` and `reconcile`. The CLI acts as an operator principal."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import typer

import stopline
from stopline.cli import _common as c
from stopline.cli.progress import progress
from stopline.cli.views import CLI_TERMS, acting_as, lands_until
from stopline.domain.advice import Do, Step, Terms
from stopline.domain.guidance import review_step, what_to_do
from stopline.domain.model import RunRecord
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import RunState
from stopline.errors import RunEnded
from stopline.ledger.schema import NOTHING_TO_RESUME
from stopline.runtime.lifecycle import Resumed
from stopline.runtime.reconcile import ReconcileSummary
from stopline.runtime.review import REVIEW_STATUSES

__all__ = ["register"]

RunArg = Annotated[str, typer.Argument(help="The run id.", metavar="RUN")]
ByOpt = Annotated[
    str, typer.Option(help="Who asks; recorded in the ledger.", envvar="STOPLINE_PRINCIPAL")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def _show(result: Any, as_json: bool) -> int:
    if isinstance(result, Receipt):
        c.emit_receipt(result, as_json)  # its recovery steps as commands
        return c.exit_code_for(result)
    to_json = getattr(result, "to_json", None)
    if as_json:
        c.print_json(to_json() if callable(to_json) else result)
    else:
        c.out.print(str(result))
    return c.EXIT_OK


def _unanswered(what: str, run_id: str, again: str) -> str:
    """Ctrl-C before the ledger's answer: the write may have landed (R3's rule)."""
    return (
        f"interrupted before the ledger answered: the {what} may be recorded or not. "
        f"See with: stopline show {run_id} ({again})"
    )


def pause(
    ctx: typer.Context,
    run_id: RunArg,
    reason: Annotated[str, typer.Option(help="Why; recorded in the ledger.")] = "",
    by: ByOpt = "cli:operator",
    as_json: JsonOpt = False,
) -> None:
    """Pause a run: dispatch stops at the next boundary, initiate is suspended (R9).

    Exit code 0 once paused; 3 while pausing (a call in flight finishes first); 5 when
    there is nothing to pause (it ended, or a cancel stopped it).
    """
    url = c.options(ctx).url
    who = acting_as(by)  # before the ledger is opened: a refusal would be logged there

    async def go() -> Receipt | RunEnded:
        async with c.opened(url) as ledger:
            try:
                return await ledger.pause(run_id, by=who, reason=reason)
            except RunEnded as exc:  # ended, or stopped by a cancel: nothing was written
                return exc

    result = c.run_sync(go, interrupted=_unanswered("pause", run_id, "pausing again is safe"))
    if isinstance(result, RunEnded):
        state = result.state.value
        if as_json:
            c.print_json({"run_id": run_id, "run_state": state, "paused": False})
        else:
            c.out.print(f"nothing to pause: run {run_id} is {state}")
        raise typer.Exit(c.EXIT_NOTHING_TO_DO)
    _show(result, as_json)
    # 0 once paused; 3 while pausing (a call in flight finishes first)
    paused = isinstance(result, Receipt) and result.run_state is RunState.PAUSED
    raise typer.Exit(c.EXIT_OK if paused else c.EXIT_PENDING)


def resume(
    ctx: typer.Context,
    run_id: RunArg,
    by: ByOpt = "cli:operator",
    as_json: JsonOpt = False,
) -> None:
    """Resume a paused or cancelled run from its last evidenced checkpoint (R10).

    Exit code 0 once it runs again; 5 when there is nothing to resume (it is
    running already, or it completed or failed on its own).
    """
    url = c.options(ctx).url
    who = acting_as(by)  # before the ledger is opened: a refusal would be logged there

    async def go() -> Resumed | RunRecord:
        async with c.opened(url) as ledger:
            run = await ledger.backend.get_run(run_id)
            if run.state in NOTHING_TO_RESUME:
                return run
            try:
                return await ledger.resume(run_id, by=who)
            except RunEnded as exc:  # how to go on, as a shell user does it
                now = dataclasses.replace(run, state=RunState(exc.state.value))
                terms = await _review_terms(ledger, run_id)
                raise RunEnded(run_id, exc.state, what_to_do(now, terms=terms)) from exc

    again = "a resume recorded already is not repeated: resuming again says nothing to resume"
    result = c.run_sync(go, interrupted=_unanswered("resume", run_id, again))
    if isinstance(result, RunRecord):
        message = f"nothing to resume: run {result.id} is {result.state.value}"
        if as_json:
            c.print_json({"run_id": result.id, "run_state": result.state.value, "resumed": False})
        else:
            c.out.print(message)
        raise typer.Exit(c.EXIT_NOTHING_TO_DO)
    raise typer.Exit(_show(result, as_json))


async def _review_terms(ledger: stopline.Ledger, run_id: str) -> Terms:
    """The CLI's terms; while an operation in review may still land (its horizon, R13),
    its review step says ``--as not_committed`` is refused until then (ADR 0092)."""
    ops = await ledger.backend.operations(run_id)
    review = [op for op in ops if op.status in REVIEW_STATUSES]
    horizon = review_step(run_id, review).horizon if review else None
    if not lands_until(horizon):
        return CLI_TERMS
    step = Step(Do.REVIEW, run_id, horizon=horizon)
    return {**CLI_TERMS, Do.REVIEW: lambda _: CLI_TERMS[Do.REVIEW](step)}


def reconcile(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Reconcile operations left requested or unknown (after a crash) by read-back.

    Exit code 0 when every operation checked was settled by its read-back, 4 when
    some went to human review, 3 when some are still in doubt (or not verifiable
    in this process).
    """
    url = c.options(ctx).url

    async def go() -> ReconcileSummary:
        async with c.opened(url) as ledger:
            with progress("reconciling (Ctrl-C stops; nothing is lost)") as bar:
                return await ledger.reconcile(on_progress=bar.update)

    result = c.run_sync(
        go,
        interrupted="interrupted; what was recovered and reconciled is in the ledger, and "
        "what went to review is not reported again: `stopline review list` shows it. "
        "`stopline reconcile` goes on from there (a read-back never sends anything again)",
    )
    _show(result, as_json)
    if result.needs_review:
        raise typer.Exit(c.EXIT_NEEDS_REVIEW)
    doubt = result.still_unknown or result.still_accepted or result.not_here
    raise typer.Exit(c.EXIT_PENDING if doubt else c.EXIT_OK)


def register(app: typer.Typer) -> None:
    app.command()(pause)
    app.command()(resume)
    app.command()(reconcile)
