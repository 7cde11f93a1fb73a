"""`stopline console`, `demo` and `bench`."""

from __future__ import annotations

import os
import secrets
from typing import Annotated

import typer

from stopline.cli import _common as c
from stopline.cli.views import UsageError
from stopline.ledger import redact

__all__ = ["register"]


def console(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Interface to bind; keep it local.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 8765,
    token: Annotated[
        str | None,
        typer.Option(help="Access token (default: $STOPLINE_CONSOLE_TOKEN, else a random one)."),
    ] = None,
    principal: Annotated[
        str | None,
        typer.Option(help="Record actions as this principal (default console:<login name>)."),
    ] = None,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-host",
            metavar="HOST",
            help="Also answer to this host name in Host and Origin (repeatable); "
            "by default only localhost, 127.0.0.1 and ::1.",
        ),
    ] = None,
) -> None:
    """Serve the web console: runs, timelines, receipts, the review queue, stats, cancel.

    Exit code 1 when the ledger cannot be read or the port cannot be used; 2 when
    the console extra is missing; 0 after Ctrl-C.
    """
    c.require_extra("console", "jinja2", "starlette", "uvicorn", "python_multipart")
    from stopline.console import (
        ConsoleConfig,
        check_principal,
        every_interface,
        listen,
        local_url,
        serve,
    )

    token = token or os.environ.get("STOPLINE_CONSOLE_TOKEN") or secrets.token_urlsafe(24)
    url = c.options(ctx).url
    if principal is not None:  # usage (exit 2), before anything is opened or bound
        check_principal("--principal", principal)
    config = ConsoleConfig(
        url=url, token=token, principal=principal, allowed_hosts=tuple(allow_host or ())
    )

    c.run_sync(  # a typed error for what is not a ledger
        lambda: c.check_ledger(url), interrupted="interrupted before the console started"
    )
    sock = listen(host, port)

    def ready() -> None:  # the ledger is open and the port bound: only now an address
        c.err.print(f"stopline console for {redact(url)}")
        if every_interface(sock):
            c.err.print(
                f"listening on every interface ({sock.getsockname()[0]}): other machines "
                "reach it by a name given with --allow-host, with the token"
            )
        c.err.print(f"open {local_url(sock)}?token={token}")

    try:
        serve(config, sock, ready=ready)
    except KeyboardInterrupt:
        c.err.print("stopline console stopped")


def demo(ctx: typer.Context) -> None:
    """Run the report-upload-notify demo: six stops, each receipt under its headline.

    With --ledger (or $STOPLINE_LEDGER) its runs stay there, for runs, show and the console.
    """
    from stopline import demo as demo_module

    raise typer.Exit(demo_module.main(c.options(ctx).ledger))


def bench(
    quick: Annotated[bool, typer.Option(help="A short run (CI).")] = False,
    json_path: Annotated[str | None, typer.Option("--json", help="Also write JSON here.")] = None,
    postgres: Annotated[
        str | None, typer.Option(help="Also benchmark this PostgreSQL URL.")
    ] = None,
    peers: Annotated[
        bool,
        typer.Option(help="Also DBOS, Temporal and bare sqlite3 (stopline[bench-peers])."),
    ] = False,
    rounds: Annotated[
        int,
        typer.Option(
            min=1, help="Run it all N times; each figure is the round with the median ratio."
        ),
    ] = 1,
    soak: Annotated[
        bool,
        typer.Option(
            help="Instead: 4 workers, a canceller, random faults (not in CI); on SQLite, "
            "or on the --postgres server"
        ),
    ] = False,
    minutes: Annotated[
        float | None, typer.Option(help="With --soak: how long (default 2).", show_default=False)
    ] = None,
    crash: Annotated[
        bool,
        typer.Option(
            help="With --soak: workers killed (SIGKILL) at random too, replaced, and the "
            "killed workers' runs judged once recovered"
        ),
    ] = False,
) -> None:
    """Benchmarks beside a baseline in the same run, as ratios."""
    from stopline import bench as bench_module

    if not soak and (crash or minutes is not None):
        raise UsageError("--crash and --minutes go with --soak")
    if soak and (quick or json_path or peers or rounds != 1):
        raise UsageError("--soak takes --minutes, --crash and --postgres, no other option")
    if soak:
        from stopline.bench import soak as soak_module

        seconds = 60 * (2.0 if minutes is None else minutes)
        raise typer.Exit(soak_module.main(seconds=seconds, postgres=postgres, crashes=crash))

    raise typer.Exit(
        bench_module.main(
            quick=quick, json_path=json_path, postgres=postgres, peers=peers, rounds=rounds
        )
    )


def register(app: typer.Typer) -> None:
    app.command()(console)
    app.command()(demo)
    app.command()(bench)
