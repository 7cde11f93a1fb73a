"""`stopline pause`, `resume` and `reconcile`.

Each is looked up on the ledger at run time; a runtime without one says so
and exits 1 rather than pretending. The CLI acts as an operator principal.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from stopline.cli import _common as c
from stopline.domain.lifecycle import operator
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import RunState

__all__ = ["register"]

RunArg = Annotated[str, typer.Argument(help="The run id.", metavar="RUN")]
ByOpt = Annotated[
    str, typer.Option(help="Who asks; recorded in the ledger.", envvar="STOPLINE_PRINCIPAL")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def _show(result: Any, as_json: bool) -> int:
    if isinstance(result, Receipt):
        if as_json:
            c.print_json(result.to_json())
        else:
            c.print_receipt(result)
        return c.exit_code_for(result)
    to_json = getattr(result, "to_json", None)
    if as_json:
        c.print_json(to_json() if callable(to_json) else result)
    else:
        c.out.print(str(result), markup=False)
    return c.EXIT_OK


def _lifecycle(url: str, command: str, name: str, *args: Any, **kwargs: Any) -> Any:
    async def go() -> Any:
        async with c.opened(url) as ledger:
            fn = c.method(ledger, command, name)
            return await fn(*args, **kwargs)

    return c.run_sync(go)


def pause(
    ctx: typer.Context,
    run_id: RunArg,
    reason: Annotated[str, typer.Option(help="Why; recorded in the ledger.")] = "",
    by: ByOpt = "cli:operator",
    as_json: JsonOpt = False,
) -> None:
    """Pause a run: dispatch stops at the next boundary, initiate is suspended (R9)."""
    result = _lifecycle(
        c.options(ctx).url, "pause", "pause", run_id, by=operator(by), reason=reason
    )
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
    """Resume a paused run from its last evidenced checkpoint (R10)."""
    result = _lifecycle(c.options(ctx).url, "resume", "resume", run_id, by=operator(by))
    raise typer.Exit(_show(result, as_json))


def reconcile(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Reconcile operations left requested or unknown (after a crash) by read-back."""
    url = c.options(ctx).url

    async def go() -> Any:
        async with c.opened(url) as ledger:
            fn = c.method(ledger, "reconcile", "reconcile")
            with c.err.status("reconciling (Ctrl-C stops; nothing is lost)"):
                return await fn()

    try:
        result = c.run_sync(go)
    except KeyboardInterrupt:
        c.fail("interrupted; what was reconciled is in the ledger", c.EXIT_PENDING)
    raise typer.Exit(_show(result, as_json))


def register(app: typer.Typer) -> None:
    app.command()(pause)
    app.command()(resume)
    app.command()(reconcile)
