"""What every command shares: the ledger it opens, output, errors, exit codes."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn, TypeAlias, TypeVar

import typer
from rich.console import Console
from rich.style import Style
from rich.text import Text

import stopline
from stopline.cli._loop import drive
from stopline.cli.views import CLI_TERMS
from stopline.domain.limits import shown_whole
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import Headline
from stopline.errors import LedgerUnavailable, SchemaTooOld, StoplineError
from stopline.ledger import open_backend, resolve_url

__all__ = [
    "EXIT_ERROR",
    "EXIT_NEEDS_REVIEW",
    "EXIT_NOTHING_TO_DO",
    "EXIT_OK",
    "EXIT_PENDING",
    "EXIT_USAGE",
    "READ_INTERRUPTED",
    "STOPPING",
    "Interrupt",
    "MissingExtra",
    "Options",
    "Terminal",
    "check_ledger",
    "err",
    "exit_code_for",
    "fail",
    "opened",
    "out",
    "print_json",
    "printable",
    "reading",
    "require_extra",
    "run_sync",
    "styled",
]

EXIT_OK = 0  # settled (or a read that succeeded)
EXIT_ERROR = 1  # unknown run, bad ledger URL, corrupt file, feature not available
EXIT_USAGE = 2  # bad arguments, or an optional extra the command needs is missing
EXIT_PENDING = 3  # still verifying or awaiting confirmation (or Ctrl-C while waiting)
EXIT_NEEDS_REVIEW = 4  # a human must decide an outcome
EXIT_NOTHING_TO_DO = 5  # resume or pause with nothing to act on: nothing happened


def printable(value: object) -> str:
    """``value`` as a terminal may show it: every control character but newline and tab
    replaced by U+FFFD (``sanitise``'s rule), so no text from a ledger, an exception or a
    server can move the cursor, retitle the window or clear the screen; and each
    bidirectional control written as its code point (``<U+202E>``), so that none
    reorders what is shown (ADR 0070). Nothing is cut off."""
    return shown_whole(value)


def styled(*parts: str | tuple[str, str]) -> Text:
    """One line of ``text`` or ``(text, style)`` pieces, each made ``printable``: how a
    command styles what it prints (``Terminal`` reads no markup)."""
    line = Text()
    for part in parts:
        text, style = (part, "") if isinstance(part, str) else part
        line.append(printable(text), style=style)
    return line


class Terminal(Console):
    """A rich console on which every string is shown as exactly what it holds.

    Run names, ids, owners, reasons, descriptions and error messages come from the
    ledger, the command line or another program, and every one reaches the terminal as
    a string through ``render_str`` (``print``, a table's cells, a title). Here that
    string is never read as markup (``[/x]`` raised ``MarkupError``, ``run_[red]1``
    printed as ``run_1``), nor as ``:emoji:`` codes, nor highlighted, and its control
    characters are replaced (``printable``). Style comes only from ``style=`` or from a
    ``Text`` built with ``styled``.
    """

    def __init__(self, *, stderr: bool = False) -> None:
        super().__init__(stderr=stderr, markup=False, emoji=False, highlight=False, soft_wrap=True)

    def render_str(
        self,
        text: str,
        *,
        style: str | Style = "",
        justify: Any = None,
        overflow: Any = None,
        emoji: bool | None = None,
        markup: bool | None = None,
        highlight: bool | None = None,
        highlighter: Any = None,
    ) -> Text:
        # every string is literal text, whatever a caller asks (markup=True included)
        return super().render_str(
            printable(text),
            style=style,
            justify=justify,
            overflow=overflow,
            emoji=False,
            markup=False,
            highlight=False,
        )


out = Terminal()
err = Terminal(stderr=True)

T = TypeVar("T")


# The optional extra that provides each module a command may import (pyproject.toml):
# the package's one table, which its imports use too (ADR 0081).
EXTRA_OF_MODULE = stopline.EXTRA_OF_MODULE


class MissingExtra(StoplineError):
    """A command needs an optional extra that is not installed (exit code 2)."""

    def __init__(self, extra: str, module: str) -> None:
        self.extra = extra
        self.module = module
        super().__init__(
            f"this needs the '{extra}' extra (module {module!r} is not installed): "
            f"pip install 'stopline[{extra}]'"
        )

    @classmethod
    def of(cls, exc: ModuleNotFoundError) -> MissingExtra | None:
        """The extra behind a failed import, or None when no extra provides that module."""
        top = (exc.name or "").partition(".")[0]
        extra = EXTRA_OF_MODULE.get(top)
        return None if extra is None else cls(extra, top)


def require_extra(extra: str, *modules: str) -> None:
    """Raise ``MissingExtra`` unless every module of ``extra`` can be imported."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(extra, module)


@dataclasses.dataclass(slots=True)
class Options:
    """Global options, kept on the typer context."""

    ledger: str | None = None

    @property
    def url(self) -> str:
        return resolve_url(self.ledger)


def options(ctx: typer.Context) -> Options:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, Options) else Options()


def _check_exists(url: str) -> None:
    """A command must not create an empty ledger where the operator mistyped a path."""
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///").split("?", 1)[0])
        if path.is_dir():
            raise LedgerUnavailable(url, "that is a directory: name the ledger file in it")
        if not path.exists():
            raise LedgerUnavailable(url, "no ledger file there (set --ledger or $STOPLINE_LEDGER)")
    elif url.startswith(("postgresql://", "postgres://")):
        require_extra("postgres", "psycopg", "psycopg_pool")


@contextlib.asynccontextmanager
async def reading(url: str) -> AsyncIterator[stopline.Ledger]:
    """A read: the ledger opened read-only, so neither it nor its file changes.

    No recovery runs and no worker registers; a file or database that is not a
    stopline ledger is refused with a typed error and left as it was.
    """
    _check_exists(url)
    backend = await open_backend(url, read_only=True)
    try:
        yield stopline.Ledger(url, backend=backend)
    finally:
        await backend.close()


async def check_ledger(url: str) -> None:
    """Before a read-write open: the URL holds a stopline ledger, not too new for this
    stopline, checked by a read-only open (a mistyped path is not created, a foreign
    file is not touched). One older than a read-only open reads passes: the read-write
    open migrates it."""
    try:
        async with reading(url):
            pass
    except SchemaTooOld:
        pass


@contextlib.asynccontextmanager
async def opened(url: str) -> AsyncIterator[stopline.Ledger]:
    """A write: to an existing stopline ledger only (``check_ledger``)."""
    await check_ledger(url)
    async with stopline.open(url) as ledger:
        yield ledger


# What a command says when Ctrl-C stops it: a message (printed on stderr, exit 3), or a
# function that prints what is known and returns the exit code.
Interrupt: TypeAlias = str | Callable[[], int]
READ_INTERRUPTED = "interrupted; nothing was changed (a read)"
# Said at once by the first Ctrl-C, before the command's own line: what it did, and what
# a second does. Until it was, a first press on a statement waiting for another
# process's lock showed nothing until the second.
STOPPING = (
    "stopping: the command ends once the ledger has answered what it already sent "
    "(that may wait for another process's lock); Ctrl-C again ends it now"
)


def run_sync(fn: Callable[[], Awaitable[T]], *, interrupted: Interrupt) -> T:
    """Run one coroutine on a fresh event loop (asyncio); Ctrl-C ends the command saying
    ``interrupted`` (what is known of what it recorded), never with a bare exit.

    The loop runs in a daemon thread while the main thread waits for it and takes the
    Ctrl-Cs (``cli._loop``). The first cancels the coroutine through an anyio cancel scope
    (not asyncio's native ``task.cancel()``: a native cancel landing in a shielded
    section or with a poll's deadline can be taken for it and swallowed, and the command
    would wait on until its own timeout), says so at once on stderr (``STOPPING``), and
    the command ends once the coroutine has unwound, its ledger closed; a statement
    already sent may still finish, and then its result is the command's. A second
    Ctrl-C interrupts at once: the threads the loop
    started are daemons too, so one still blocked in a statement (a SQLite lock wait)
    no longer holds the interpreter's exit, as it did for ever.
    """
    report = interrupted if callable(interrupted) else _saying(interrupted)
    try:
        return drive(fn, said=_stopping)
    except KeyboardInterrupt:
        raise typer.Exit(report()) from None


def _stopping() -> None:
    err.print(f"stopline: {STOPPING}")


def _saying(message: str) -> Callable[[], int]:
    def report() -> int:
        err.print(f"stopline: {message}")
        return EXIT_PENDING

    return report


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    err.print(f"stopline: error: {message}")
    raise typer.Exit(code)


def exit_code_for(receipt: Receipt) -> int:
    """0 settled, 4 needs review, 3 anything still moving (verifying, awaiting, running)."""
    if receipt.headline is Headline.NEEDS_REVIEW:
        return EXIT_NEEDS_REVIEW
    return EXIT_OK if receipt.settled else EXIT_PENDING


_HEADLINE_STYLE = {
    Headline.NEEDS_REVIEW: "bold red",
    Headline.VERIFYING: "yellow",
    Headline.AWAITING_CONFIRMATION: "yellow",
    Headline.CORRECTION_QUEUED: "yellow",
    Headline.STOPPED_WITH_COMPLETED_ACTIONS: "cyan",
    Headline.CORRECTED: "cyan",
    Headline.CANCELED_BEFORE_EXTERNAL_ACTION: "green",
    Headline.COMPLETED: "green",
    Headline.FAILED: "red",
}


def cli_receipt(receipt: Receipt) -> Receipt:
    """The receipt as the CLI says it: its recovery steps as commands (ADR 0066)."""
    return receipt.worded(CLI_TERMS)


def emit_receipt(receipt: Receipt, as_json: bool) -> None:
    """A receipt printed, or as JSON, in the CLI's terms."""
    if as_json:
        print_json(cli_receipt(receipt).to_json())
    else:
        print_receipt(receipt)


def print_receipt(receipt: Receipt) -> None:
    receipt = cli_receipt(receipt)
    out.print(receipt.message, style=_HEADLINE_STYLE.get(receipt.headline, ""))
    for line in receipt.lines:
        out.print(f"  {line.text()}")
    if receipt.cancelled_by:
        reason = f" ({receipt.cancel_reason})" if receipt.cancel_reason else ""
        out.print(f"  cancelled by {receipt.cancelled_by}{reason}")
    if receipt.resume_rule:
        out.print(f"  resume: {receipt.resume_rule}")
    state = f"{receipt.run_state.value}, {_progress(receipt)}"
    out.print(f"  run {receipt.run_id}: {state}", style="dim")


def _progress(receipt: Receipt) -> str:
    """How far the receipt is from final, in the words of the exit codes: a run in
    review is not "settled" to a reader, since a reviewer's decision changes it."""
    if receipt.headline is Headline.NEEDS_REVIEW:
        return "waiting for a reviewer"
    return "settled" if receipt.settled else "not settled yet"
