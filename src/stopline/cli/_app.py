"""The ``stopline`` command: global options, the command groups, error handling."""

from __future__ import annotations

import codecs
import io
import sys
from collections.abc import Sequence
from typing import Annotated

import click
import typer

from stopline.cli import _common as c
from stopline.cli import check_mcp, extras, lifecycle, mapping, review, runs, stats
from stopline.cli.views import UsageError
from stopline.errors import InvalidInput, StoplineError

__all__ = ["app", "interrupted_at_start", "main"]

app = typer.Typer(
    name="stopline",
    help="See and act on agent runs: runs, receipts, cancel, review, stats.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    """``--version``: the release and the newest ledger schema it writes (a ledger
    written by a newer release is refused as ``SchemaTooNew`` naming that number)."""
    if value:
        from stopline import __version__
        from stopline.ledger.schema import SCHEMA_VERSION

        c.out.print(f"stopline {__version__} (ledger schema {SCHEMA_VERSION})", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _global(
    ctx: typer.Context,
    ledger: Annotated[
        str | None,
        typer.Option(
            "--ledger",
            envvar="STOPLINE_LEDGER",
            help="Ledger URL (default sqlite:///stopline.db).",
            show_envvar=True,
        ),
    ] = None,
    _: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version,
            is_eager=True,
            help="Show the release and the ledger schema it writes, and exit.",
        ),
    ] = False,
) -> None:
    if ledger is not None and not ledger.strip():  # it opened the default ledger instead
        c.fail("--ledger is empty: name a ledger, or leave it out", c.EXIT_USAGE)
    ctx.obj = c.Options(ledger=ledger)


runs.register(app)
lifecycle.register(app)
app.add_typer(review.app, name="review")
mapping.register(app)
stats.register(app)
extras.register(app)
check_mcp.register(app)


def _printable_stdout() -> None:
    """Where stdout's encoding cannot show every character (``LANG=C`` without UTF-8,
    ``PYTHONIOENCODING=ascii``), a character it lacks prints escaped (``caf\\xe9``)
    instead of ending the command with a ``UnicodeEncodeError`` traceback. (stderr
    escapes so already.)"""
    stream = sys.stdout
    encoding = getattr(stream, "encoding", None) or "utf-8"
    if isinstance(stream, io.TextIOWrapper) and codecs.lookup(encoding).name != "utf-8":
        stream.reconfigure(errors="backslashreplace")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: errors are one line on stderr, never a traceback; returns the exit code."""
    _printable_stdout()
    try:
        app(args=list(argv) if argv is not None else None, prog_name="stopline")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else c.EXIT_ERROR)
    except c.MissingExtra as exc:
        c.err.print(f"stopline: {exc}")
        return c.EXIT_USAGE
    except ModuleNotFoundError as exc:
        missing = c.MissingExtra.of(exc)
        if missing is None:
            c.err.print(f"stopline: error: {exc}")
            return c.EXIT_ERROR
        c.err.print(f"stopline: {missing}")
        return c.EXIT_USAGE
    except (UsageError, InvalidInput) as exc:  # an argument refused before anything ran
        c.err.print(f"stopline: usage: {exc}")
        return c.EXIT_USAGE
    except StoplineError as exc:
        c.err.print(f"stopline: error: {exc}")
        return c.EXIT_ERROR
    except NotImplementedError:
        c.err.print("stopline: error: not available in this version")
        return c.EXIT_ERROR
    except click.exceptions.Abort:
        c.err.print("stopline: interrupted")
        return c.EXIT_PENDING
    except KeyboardInterrupt:
        c.err.print("stopline: interrupted; nothing recorded is lost")
        return c.EXIT_PENDING
    except OSError as exc:
        c.err.print(f"stopline: error: {exc}")
        return c.EXIT_ERROR
    return c.EXIT_OK


# The commands a Ctrl-C ends with 130, as a shell's does; the others end with 3 (docs/cli.md).
_SHELL_CTRL_C = frozenset({"demo", "bench", "map", "check-mcp"})
_EXIT_SHELL_CTRL_C = 130


def interrupted_at_start(argv: Sequence[str] | None = None) -> int:
    """A Ctrl-C while the command's modules imported (``stopline.cli.main``): it ends
    before it starts, nothing done, with the code a Ctrl-C of that command ends with."""
    c.err.print("stopline: interrupted before the command started; nothing was done")
    args = list(sys.argv[1:] if argv is None else argv)
    return _EXIT_SHELL_CTRL_C if _command(args) in _SHELL_CTRL_C else c.EXIT_PENDING


def _command(args: list[str]) -> str | None:
    """The command ``args`` name: the first word after the global options."""
    rest = iter(args)
    for arg in rest:
        if arg == "--ledger":
            next(rest, None)  # its value
        elif not arg.startswith("-"):
            return arg
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
