"""``stopline check-mcp``: the cancellation profile of an MCP server (docs/check-mcp.md).

    stopline check-mcp [--json] [--plan FILE] [--era ERA] -- COMMAND [ARGS...]   # stdio
    stopline check-mcp [--json] [--plan FILE] [--era ERA] URL                    # Streamable HTTP

``--era auto`` (the default) negotiates: 2026-07-28 when the server offers it, else the
2025 handshake; an explicit ``2026-07-28`` against a server that answers only the old
way fails with a usage error that names ``--era legacy``.

Exit codes: 0 no findings, 1 findings, 2 a bad plan or no connection.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import anyio
import typer

from stopline.cli import _common as c
from stopline.cli.progress import progress
from stopline.domain.limits import check_wait
from stopline.errors import InvalidInput, NoAnswer

__all__ = ["register"]

ERAS = ("auto", "2026-07-28", "legacy")


def check_mcp(
    target: Annotated[
        list[str], typer.Argument(help="A Streamable HTTP URL, or -- COMMAND [ARGS...] (stdio).")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="The profile as JSON on stdout.")] = False,
    plan: Annotated[
        Path | None,
        typer.Option(help="Tools it may call, their arguments and read tools (JSON or TOML)."),
    ] = None,
    era: Annotated[
        str,
        typer.Option(help="Protocol era: auto (negotiate, the default), 2026-07-28 or legacy."),
    ] = "auto",
    settle_timeout: Annotated[
        float, typer.Option(help="Seconds to wait for each cell to settle.")
    ] = 15.0,
    connect_timeout: Annotated[
        float,
        typer.Option(help="Seconds to wait for the server to start and answer the handshake."),
    ] = 30.0,
) -> None:
    """Profile an MCP server's cancellation: discovery only, or the barrier matrix with --plan."""
    from pydantic import ValidationError

    from mcp import StdioServerParameters
    from stopline.integrations.mcp.check import PlanError, check, load_plan
    from stopline.integrations.mcp.check_report import Exit, render_text
    from stopline.integrations.mcp.opening import first_error

    if era not in ERAS:
        c.fail(f"--era must be one of {', '.join(ERAS)}", Exit.ERROR)
    try:  # NaN failed the first cell, after its call was made
        check_wait("--settle-timeout", settle_timeout)
        check_wait("--connect-timeout", connect_timeout)
    except InvalidInput as exc:
        c.fail(str(exc), Exit.ERROR)
    if not target[0].strip():
        c.fail("no server given: a Streamable HTTP URL, or -- COMMAND [ARGS...]", Exit.ERROR)
    server: StdioServerParameters | str
    if len(target) == 1 and target[0].startswith(("http://", "https://")):
        server = target[0]
    else:
        server = StdioServerParameters(command=target[0], args=target[1:])
    try:
        loaded = load_plan(plan) if plan is not None else None
    except PlanError as exc:
        c.fail(str(exc), Exit.ERROR)
    steps = 1 + (len(loaded.tools) * 5 if loaded else 0)
    with progress("check-mcp", total=steps) as bar, tempfile.TemporaryDirectory() as tmp:

        def step(text: str) -> None:
            bar.describe(text)
            bar.advance()

        async def run() -> object:
            return await check(
                server,
                mode=era,
                plan=loaded,
                workdir=Path(tmp),
                settle_timeout=settle_timeout,
                connect_timeout=connect_timeout,
                on_step=step,
            )

        try:
            profile = anyio.run(run)
        except PlanError as exc:
            c.fail(str(exc), Exit.ERROR)
        except Exception as exc:
            leaf = first_error(exc)
            # a connection that could not be opened is ``NoAnswer`` over the SDK's error
            cause = leaf.__cause__ if isinstance(leaf, NoAnswer) else None
            under = leaf if cause is None else first_error(cause)
            if isinstance(under, ValidationError) and era == "2026-07-28":
                c.fail(
                    f"cannot check {' '.join(target)}: its answers do not fit the 2026-07-28 "
                    "protocol: pass --era legacy (or --era auto to negotiate)",
                    Exit.ERROR,
                )
            c.fail(f"cannot check {' '.join(target)}: {type(leaf).__name__}: {leaf}", Exit.ERROR)
    from stopline.integrations.mcp.check_report import Profile

    assert isinstance(profile, Profile)
    if as_json:
        c.print_json(profile.to_json())
    else:
        c.out.print(render_text(profile))
    raise typer.Exit(int(profile.exit))


def register(app: typer.Typer) -> None:
    app.command("check-mcp")(check_mcp)
