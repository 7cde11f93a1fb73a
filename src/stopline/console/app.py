"""The web console: server-rendered pages over one ledger, behind a token.

Access: the token printed by ``stopline console`` (or ``$STOPLINE_CONSOLE_TOKEN``)
is accepted once as ``?token=``; the console then sets an HttpOnly,
SameSite=Strict session cookie and redirects to the same page without the
token. Every write is a POST carrying the session's CSRF token, checked
server-side. Actions are recorded in the ledger under the session's
principal (``console:<name>`` unless one is configured).

Every request's ``Host`` (and ``Origin``, when sent) must name this machine
(``localhost``, ``127.0.0.1``, ``::1``) or a host the operator allowed, so a
page on another site that rebinds its DNS name to 127.0.0.1 reaches nothing.
The ledger URL is shown without its password.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import hmac
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import jinja2
from starlette.applications import Starlette
from starlette.datastructures import URL
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import stopline
from stopline.cli.holders import holdings
from stopline.cli.stats import compute_stats, percentile
from stopline.cli.views import (
    CLI_TERMS,
    check_note,
    check_principal,
    fmt_age,
    fmt_seconds,
    fmt_time,
    lands_until,
    timeline,
)
from stopline.console.shown import finalize, shown
from stopline.console.svg import run_timeline, settle_chart
from stopline.domain.advice import Do, Step, Terms, reading_back, reviewing
from stopline.domain.guidance import correct_in_application
from stopline.domain.lifecycle import operator
from stopline.domain.model import OperationRecord
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import Headline, RunState
from stopline.errors import (
    CommitInDoubt,
    InvalidInput,
    LedgerError,
    LedgerLocked,
    LedgerUnavailable,
    NotFound,
    NotPermitted,
    StoplineError,
)
from stopline.ledger import redact
from stopline.runtime.review import REVIEW_STATUSES, ReviewVerdict

__all__ = ["LOCAL_HOSTS", "ConsoleConfig", "HostGuard", "check_principal", "create_app"]

COOKIE = "stopline_console"
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
# stored text reads as stored (ADR 0070): ``| shown`` in a page's text, ``finalize``
# for every other value printed (attributes, the <title>)
_TEMPLATES = Jinja2Templates(
    env=jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=jinja2.select_autoescape(),
        finalize=finalize,
    )
)
_TEMPLATES.env.filters["shown"] = shown
_TEMPLATES.env.globals.update(fmt_time=fmt_time, fmt_age=fmt_age, fmt_seconds=fmt_seconds)
# an id in a URL path: `?`, `#`, `%` and `/` escaped (the routes take the decoded id back)
_TEMPLATES.env.filters["q"] = lambda value: quote(str(value), safe="")
_FINAL = frozenset({RunState.CANCELLED, RunState.COMPLETED, RunState.FAILED})
# the ledger is busy (another process holds its lock) or out of reach: not the request's
# fault and not a conflict; asking again later may work (503, Retry-After)
_UNAVAILABLE = (LedgerLocked, LedgerUnavailable, CommitInDoubt)
RETRY_AFTER_SECONDS = 1


def correct_elsewhere(ledger: stopline.Ledger, op: OperationRecord) -> str:
    """Why this console cannot offer "It happened: correct it" for ``op``, which
    declares a correction, and where it is done instead; "" if it can (the ledger it
    was given has the tool registered, as an embedding application's may). A correction
    runs the tool's compensator: code in the application, not in ``stopline console``."""
    if not op.can_compensate or op.compensates is not None:
        return ""  # nothing to correct it with: the ledger says so if asked
    try:
        ledger.core.compensator.tool_for(op)
    except NotPermitted:
        return correct_in_application(op.id, op.tool, here="record it here (It happened)")
    return ""


def awaits_review(receipt: Receipt) -> bool:
    """A receipt settled in the sense that nothing changes it by itself, but that a
    reviewer's decision will: the page says so and keeps following it."""
    return receipt.settled and receipt.headline is Headline.NEEDS_REVIEW


_TEMPLATES.env.globals["awaits_review"] = awaits_review


def _not_yet(step: Step) -> str:
    """R13: while an operation's effect may still land, "It did not happen" is refused
    (ADR 0092); the queue says until when for each."""
    until = lands_until(step.horizon)
    if not until:
        return ""
    if len(step.op_ids) == 1:
        return f"; \u201cIt did not happen\u201d only after {until}: its effect may land until then"
    return (
        "; \u201cIt did not happen\u201d only once an operation's effect can no longer land: "
        f"for one of them, not before {until}"
    )


# A recovery's steps as the console's reader takes them (ADR 0066): waiting and review
# here; the console does not resume a run, so a resume is the CLI's command, and a
# re-entry is the application's, as from a shell.
CONSOLE_TERMS: Terms = {
    **CLI_TERMS,
    Do.WAIT: lambda step: (
        "wait until it settles (this page follows it)"
        + reading_back(step, "a worker of your application opened with it; not the console")
    ),
    Do.REVIEW: lambda step: f"{reviewing(step)} (on the Review queue page{_not_yet(step)})",
    Do.RESUME: lambda step: f"{CLI_TERMS[Do.RESUME](step)} (the console does not resume runs)",
}
# an action's answer (a cancel's, a decision's) is a page of its own that does not
# refresh: its run page is the one that follows the run
ANSWER_TERMS: Terms = {
    **CONSOLE_TERMS,
    Do.WAIT: lambda step: (
        "wait until it settles (its run page follows it)"
        + reading_back(step, "a worker of your application opened with it; not the console")
    ),
}
_TEMPLATES.env.globals["recovery"] = lambda receipt, answer=False: receipt.advice.say(
    ANSWER_TERMS if answer else CONSOLE_TERMS
)


@dataclasses.dataclass(frozen=True, slots=True)
class ConsoleConfig:
    url: str
    token: str
    principal: str | None = None  # else console:<name given at login, or the login user>
    allowed_hosts: tuple[str, ...] = ()  # besides LOCAL_HOSTS, for Host and Origin

    def __post_init__(self) -> None:
        if self.principal is not None:  # refused here, not at every login after
            check_principal("principal", self.principal)


def _hostname(value: str) -> str | None:
    """The host of a ``Host`` header or an ``Origin`` (port and brackets dropped)."""
    try:
        return urlsplit(value if "//" in value else f"//{value}").hostname
    except ValueError:
        return None


class HostGuard:
    """Refuse a request whose ``Host`` or ``Origin`` names a host not allowed (403)."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            host = _hostname(headers.get("host", ""))
            origin = headers.get("origin")
            refused = ""
            if host not in self.allowed:
                refused = f"host {headers.get('host', '')!r} is not allowed"
            elif origin is not None and _hostname(origin) not in self.allowed:
                refused = f"origin {origin!r} is not allowed"
            if refused:
                response = PlainTextResponse(
                    f"{refused}: the console answers only to "
                    f"{', '.join(sorted(self.allowed))} (stopline console --allow-host)",
                    status_code=403,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# every response's, unless it set its own (a page's CSP carries its nonce; the token
# redirect's referrer policy is stricter): a redirect, the host guard's 403 and the
# router's 404 carried none
_SECURE = {
    b"content-security-policy": b"default-src 'none'; frame-ancestors 'none'",
    b"referrer-policy": b"same-origin",
    b"x-frame-options": b"DENY",
    b"cache-control": b"no-store",
}


class SecureHeaders:
    """The console's security headers on every response, whoever made it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                given = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in _SECURE.items() if k not in given]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, sending if scope["type"] == "http" else send)


@dataclasses.dataclass(frozen=True, slots=True)
class Session:
    csrf: str
    principal: str


Handler = Callable[[Request], Awaitable[Response]]


def create_app(config: ConsoleConfig, *, ledger: stopline.Ledger | None = None) -> Starlette:
    """The console app; it opens the ledger for its lifetime unless one is given."""
    sessions: dict[str, Session] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if ledger is not None:
            app.state.ledger = ledger
            yield
            return
        async with stopline.open(config.url) as opened:
            app.state.ledger = opened
            yield

    def render(request: Request, name: str, status: int = 200, **context: Any) -> Response:
        nonce = secrets.token_urlsafe(12)
        session = request.scope.get("stopline_session")
        health = getattr(request.app.state, "ledger", None)
        health = getattr(health, "health", None)  # the error boundary's view (degraded)
        context.update(session=session, nonce=nonce, ledger_url=redact(config.url), health=health)
        response = _TEMPLATES.TemplateResponse(request, name, context, status_code=status)
        response.headers["Content-Security-Policy"] = (
            f"default-src 'none'; style-src 'nonce-{nonce}'; script-src 'nonce-{nonce}'; "
            "connect-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'"
        )
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Cache-Control"] = "no-store"
        return response

    def authed(handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            given = request.query_params.get("token")
            if given is not None:
                if not hmac.compare_digest(given.encode(), config.token.encode()):
                    return render(request, "denied.html", 403, reason="wrong token")
                name = request.query_params.get("name") or getpass.getuser()
                session_id = secrets.token_urlsafe(32)
                principal = config.principal or f"console:{name}"
                try:  # the name every action is recorded by: refused now, not at a cancel
                    check_principal("name", principal)
                except InvalidInput as exc:
                    return render(request, "denied.html", 400, reason=str(exc))
                sessions[session_id] = Session(secrets.token_urlsafe(32), principal)
                rest = {k: v for k, v in request.query_params.items() if k not in ("token", "name")}
                target = URL(path=quote(request.url.path), query=urlencode(rest))
                redirect = RedirectResponse(str(target), status_code=303)
                redirect.set_cookie(COOKIE, session_id, httponly=True, samesite="strict")
                redirect.headers["Referrer-Policy"] = "no-referrer"
                return redirect
            session = sessions.get(request.cookies.get(COOKIE, ""))
            if session is None:
                return render(request, "denied.html", 401, reason="token required")
            request.scope["stopline_session"] = session
            if request.method == "POST":
                form = await request.form()
                sent = str(form.get("csrf", ""))
                if not hmac.compare_digest(sent.encode(), session.csrf.encode()):
                    return render(request, "denied.html", 403, reason="bad or missing CSRF token")
            try:
                return await handler(request)
            except NotFound as exc:
                return render(request, "error.html", 404, message=str(exc))
            except InvalidInput as exc:  # an id or a field no ledger can hold
                return render(request, "error.html", 400, message=str(exc))
            except _UNAVAILABLE as exc:
                busy = render(request, "error.html", 503, message=str(exc))
                busy.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
                return busy
            except LedgerError as exc:  # it cannot serve at all (corrupt, gone, too new)
                return render(request, "error.html", 500, message=str(exc), broken=True)
            except StoplineError as exc:  # what the contract refuses (an illegal transition)
                return render(request, "error.html", 409, message=str(exc))

        return wrapped

    def the_ledger(request: Request) -> stopline.Ledger:
        found: stopline.Ledger = request.app.state.ledger
        return found

    async def runs_page(request: Request) -> Response:
        ledger = the_ledger(request)
        state_arg = request.query_params.get("state", "")
        if state_arg and state_arg not in {s.value for s in RunState}:  # not every run
            known = ", ".join(s.value for s in RunState)
            message = f"state: {state_arg!r} is not a run state (one of: {known})"
            return render(request, "error.html", 400, message=message)
        state = RunState(state_arg) if state_arg else None
        rows = await ledger.runs_with_receipts(state=state, limit=200)
        partial = request.query_params.get("partial") == "1"
        return render(
            request,
            "runs.html",
            rows=rows,
            held=await holdings(ledger.backend, [run for run, _ in rows]),
            state=state,
            states=list(RunState),
            live=True,
            partial=partial,
        )

    async def run_page(request: Request) -> Response:
        ledger = the_ledger(request)
        run_id = request.path_params["run_id"]
        run = await ledger.backend.get_run(run_id)
        ops = await ledger.backend.operations(run_id)
        events = await ledger.backend.events(run_id)
        receipt = await ledger.receipt(run_id)
        entries = timeline(events, ops)
        return render(
            request,
            "run.html",
            run=run,
            ops=ops,
            timeline=entries,
            picture=run_timeline(entries, ops),
            receipt=receipt,
            holding=(await holdings(ledger.backend, [run])).get(run.id),
            can_cancel=not run.state.fenced and run.state not in _FINAL,
            live=not receipt.settled or awaits_review(receipt),
            partial=request.query_params.get("partial") == "1",
        )

    async def cancel_action(request: Request) -> Response:
        ledger = the_ledger(request)
        session: Session = request.scope["stopline_session"]
        form = await request.form()
        # the ledger's rule for a reason applies (stored whole up to its limit, a longer
        # one ending in "…": never a reason to refuse a cancel); it was cut at 500 here
        reason = str(form.get("reason", "")).strip()
        run_id = request.path_params["run_id"]
        receipt = await ledger.cancel(run_id, by=operator(session.principal), reason=reason)
        # R7: one cancel per run; a second (a double submit, a stale page's form, a run
        # that ended meanwhile) records nothing, and the page says so (the record's cancel)
        recorded = receipt.cancelled_by == session.principal
        return render(
            request, "receipt.html", receipt=receipt, by=session.principal, recorded=recorded
        )

    async def review_page(request: Request) -> Response:
        ledger = the_ledger(request)
        items = await ledger.review_items()
        elsewhere = {item.op.id: correct_elsewhere(ledger, item.op) for item in items}
        # R13: "it did not happen" is refused until then (the ledger's own horizon rule)
        not_before = {i.op.id: lands_until(ledger.core.settler.horizon_of(i.op)) for i in items}
        # live as the runs page: a queue gains items and loses them to other reviewers
        return render(
            request,
            "review.html",
            items=items,
            elsewhere=elsewhere,
            not_before=not_before,
            live=True,
        )

    async def resolve_action(request: Request) -> Response:
        ledger = the_ledger(request)
        session: Session = request.scope["stopline_session"]
        form = await request.form()
        try:
            verdict = ReviewVerdict.parse(str(form.get("decision", "")))
        except ValueError as exc:
            return render(request, "error.html", 400, message=str(exc))
        note = check_note(str(form.get("note", "")).strip())  # whole, or refused: 400
        op_id = request.path_params["op_id"]
        if verdict is ReviewVerdict.COMPENSATE:  # refused before anything is written
            op = await ledger.backend.get_operation(op_id)
            # only of an item in review: one decided meanwhile (a stale page's form) is
            # the ledger's refusal, "not in review: it is committed", not "record it here"
            why = correct_elsewhere(ledger, op) if op.status in REVIEW_STATUSES else ""
            if why:
                message = f"operation {op_id!r} is not corrected from here: {why}"
                return render(request, "error.html", 409, message=message)
        receipt = await ledger.resolve_review(
            op_id, verdict, by=operator(session.principal), note=note
        )
        return render(request, "receipt.html", receipt=receipt, by=session.principal)

    async def stats_page(request: Request) -> Response:
        result = await compute_stats(the_ledger(request))
        p50, p99 = percentile(result.settle_times, 50), percentile(result.settle_times, 99)
        return render(
            request,
            "stats.html",
            stats=result,
            p50=p50,
            p99=p99,
            chart=settle_chart(result.settle_times, p50, p99),
            live=False,
            partial=False,
        )

    routes = [
        Route("/", authed(runs_page)),
        Route("/runs/{run_id:path}/cancel", authed(cancel_action), methods=["POST"]),
        Route("/runs/{run_id:path}", authed(run_page)),
        Route("/review", authed(review_page)),
        Route("/review/{op_id:path}/resolve", authed(resolve_action), methods=["POST"]),
        Route("/stats", authed(stats_page)),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    if ledger is not None:  # served without a lifespan (an ASGI server's lifespan="off")
        app.state.ledger = ledger
    app.add_middleware(HostGuard, allowed=LOCAL_HOSTS | frozenset(config.allowed_hosts))
    app.add_middleware(SecureHeaders)  # outermost: the guard's refusals too
    return app
