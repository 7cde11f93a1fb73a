"""Inputs that cannot be stored never weaken the fence (R1), and are refused at the
API with a typed error naming the field, the ledger unchanged; stopline's own options
on ``run.call`` cannot be taken for a tool's arguments; entering or resuming a run
that has ended says what to do (R14)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any, cast

import anyio
import pytest

import stopline
from stopline import InvalidInput, OpStatus, RunEnded, RunState
from stopline.testing import FakeProvider

pytestmark = pytest.mark.timeout(30)

BAD_TEXT = {"surrogate": "stop \udc80 now", "nul": "stop \x00 now", "c1": "stop \x9b now"}


@pytest.mark.parametrize("bad", list(BAD_TEXT), ids=list(BAD_TEXT))
async def test_r1_a_cancel_whose_reason_cannot_be_stored_still_fences(
    ledger: stopline.Ledger, bad: str
) -> None:
    provider = FakeProvider("send")
    async with ledger.run("job", owner="user:1", run_id="run-reason") as run:
        await ledger.cancel(run.id, by="user:1", reason=BAD_TEXT[bad])
        with pytest.raises(stopline.RunCancelled):
            await run.call(provider.tool, 1, key="after")  # refused at the gate
    receipt = await ledger.wait_settled("run-reason", timeout=10)
    assert receipt.run_state is RunState.CANCELLED
    assert receipt.cancel_reason == "stop \ufffd now"
    assert provider.requests == []


@pytest.mark.parametrize(
    "run_id",
    ["", "a\udc80b", "a\x00b", "x" * 5000],
    ids=["empty", "surrogate", "nul", "too-long"],
)
async def test_ids_that_cannot_be_stored_are_refused_naming_the_field(
    ledger: stopline.Ledger, run_id: str
) -> None:
    with pytest.raises(InvalidInput) as refused:
        async with ledger.run("job", owner="user:1", run_id=run_id):
            pass
    assert refused.value.what == "run_id"
    with pytest.raises(InvalidInput, match="by"):
        await ledger.cancel("run-x", by="user\x00:1")
    assert await ledger.backend.list_runs(limit=10) == []  # nothing was written


async def test_sharing_with_an_owner_that_is_no_run_id_is_refused_naming_it(
    ledger: stopline.Ledger,
) -> None:
    """``share(run_id, with_owner=...)`` takes the owning run's id: an empty one, a NUL
    or a number went to the storage and came back as "unknown run id"."""
    async with ledger.run("job", owner="user:1", run_id="run-shared"):
        pass
    bad_owners: tuple[Any, ...] = ("", "a\x00", 5)
    for bad in bad_owners:
        with pytest.raises(InvalidInput) as refused:
            await ledger.share("run-shared", with_owner=bad, by="user:1")
        assert refused.value.what == "with_owner"


async def test_a_read_by_an_id_no_ledger_holds_is_the_same_answer_on_both_engines(
    ledger: stopline.Ledger,
) -> None:
    """A NUL in an id to look up (a console URL's ``%00``): SQLite said "unknown",
    PostgreSQL a storage error (``LedgerError``) its driver raised. Each read by one
    id, and each ``by``, is ``InvalidInput`` naming it, on both, before the read."""
    async with ledger.run("job", owner="user:1") as run:
        pass
    bad = "x\x00y"
    verdict = stopline.ReviewVerdict.parse("committed")
    reads: dict[str, Any] = {
        "run_id": [
            ledger.backend.get_run(bad),
            ledger.backend.operations(bad),
            ledger.backend.events(bad),
            ledger.backend.approvals(bad),
            ledger.backend.last_checkpoint(bad),
            ledger.why_not_approved(bad, "op"),
        ],
        "op_id": [
            ledger.backend.get_operation(bad),
            ledger.verify(bad),
            ledger.inspect_review(bad),
            ledger.resolve_review(bad, verdict, by="user:1"),
            ledger.compensate(bad, by="user:1"),
            ledger.stop_compensation(bad, by="user:1"),
        ],
        "approval_id": [ledger.approve(bad, by="user:1"), ledger.deny(bad, by="user:1")],
        "by": [ledger.receipt(run.id, by=bad), ledger.receipts([run.id], by=bad)],
    }
    for what, calls in reads.items():
        for call in calls:
            with pytest.raises(InvalidInput) as refused:
                await call
            assert refused.value.what == what, call
    assert len(await ledger.backend.events(run.id)) > 0  # the ledger answers as before


async def test_a_key_that_cannot_be_stored_is_refused_before_the_gate(
    ledger: stopline.Ledger,
) -> None:
    provider = FakeProvider("send")
    async with ledger.run("job", owner="user:1", run_id="run-key") as run:
        with pytest.raises(InvalidInput) as refused:
            await run.call(provider.tool, 1, key="k\udc80")
    assert refused.value.what == "key"
    assert await ledger.backend.operations("run-key") == []


FREE_TEXT = {**BAD_TEXT, "long": "x" * 1_000_000}
STORED = {**dict.fromkeys(BAD_TEXT, "stop \ufffd now"), "long": "x" * 4095 + "\u2026"}


@pytest.mark.parametrize("bad", list(FREE_TEXT), ids=list(FREE_TEXT))
async def test_text_a_call_brings_back_is_stored_as_it_can_be_and_the_call_recorded(
    ledger: stopline.Ledger, bad: str
) -> None:
    """A tool's description, a provider's reference, a refusal's reason or a lost
    answer's message is free text from code or a server we did not write. A NUL failed
    PostgreSQL's write (the gate "in doubt", an outcome retried for ever: the call that
    was refused stayed ``requested``), a lone surrogate every write (``UnicodeEncodeError``
    to the caller), and a megabyte was written whole, once per event. Each is stored
    with its unstorable characters replaced and cut at ``MAX_REASON_CHARS``."""
    text, stored = FREE_TEXT[bad], STORED[bad]

    async def refuse(ctx: stopline.CallContext) -> None:
        await ctx.accepted(ref=text, detail=text)
        raise stopline.Rejected(text, ref=text)

    async def lose(ctx: stopline.CallContext) -> None:
        raise stopline.NoAnswer(stopline.Cause.TIMEOUT, text)

    async with ledger.run("job", owner="user:1", run_id="run-text") as run:
        with pytest.raises(stopline.Rejected):
            await run.call(stopline.Tool(refuse, description=text), key="refused")
        with pytest.raises(stopline.NoAnswer):
            await run.call(stopline.Tool(lose), key="lost")
    refused = await ledger.backend.get_operation("run-text/refused")
    assert refused.status is OpStatus.NOT_COMMITTED
    assert refused.description == stored and refused.error == stored
    assert {e.ref for e in refused.evidence if e.ref != "gate"} == {stored}
    assert stored in {e.detail for e in refused.evidence}
    lost = await ledger.backend.get_operation("run-text/lost")
    assert lost.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
    assert stored in {e.detail for e in lost.evidence}
    receipt = await ledger.wait_settled("run-text", timeout=10)
    receipt.text().encode()  # prints: no lone surrogate left


@pytest.mark.parametrize("answer", [None, True, "done", 1], ids=["none", "true", "word", "int"])
async def test_r5_a_verifier_answer_that_is_no_verdict_proves_nothing(
    ledger_url: str, answer: Any
) -> None:
    """A verifier answering ``None``, ``True`` or a word was read as "not committed":
    the receipt said nothing happened to a call whose answer was lost. It proves
    nothing: the operation stays in doubt, and the verifier's error is kept. (The
    runtime's own read-back waits: the one read is the test's.)"""

    async def charge(ctx: stopline.CallContext) -> None:
        raise stopline.NoAnswer(stopline.Cause.TRANSPORT, "connection reset")

    tool = stopline.Tool(charge)

    @tool.verifier
    async def read(ctx: stopline.CallContext) -> Any:
        return answer

    later = stopline.VerifyBudget(first_delay=1e6)
    async with stopline.open(ledger_url, verify=later) as ledger:
        async with ledger.run("job", owner="user:1", run_id="run-v") as run:
            with pytest.raises(stopline.NoAnswer):
                await run.call(tool, key="k")
        op = await ledger.verify("run-v/k")
        assert op.status is OpStatus.UNKNOWN
        events = await ledger.backend.events("run-v")
        (failed,) = [e for e in events if e.kind == "verify_failed"]
        assert "InvalidInput: invalid verdict" in str(failed.data)


async def test_r5_a_verdict_given_as_its_string_is_that_verdict(ledger: stopline.Ledger) -> None:
    """``"committed"`` and ``"not_committed"`` (a verifier's or a late answer's) are the
    verdicts they name: a late ``"committed"`` was recorded as a refusal."""

    async def charge(ctx: stopline.CallContext) -> None:
        raise stopline.NoAnswer(stopline.Cause.TRANSPORT, "connection reset")

    tool = stopline.Tool(charge)
    answered = anyio.Event()  # the late answer is recorded before any read-back of it

    @tool.verifier
    async def read(ctx: stopline.CallContext) -> Any:
        if ctx.op_id.endswith("/late"):
            await answered.wait()  # a background read-back raced it and won (no result)
        return "committed"

    async with ledger.run("job", owner="user:1", run_id="run-w") as run:
        for key in ("read", "late"):
            with pytest.raises(stopline.NoAnswer):
                await run.call(tool, key=key)
    assert (await ledger.verify("run-w/read")).status is OpStatus.COMMITTED
    late = await ledger.late_response("run-w/late", cast(Any, "committed"), result="ok")
    answered.set()
    assert late.status is OpStatus.COMMITTED and late.result == "ok"
    with pytest.raises(InvalidInput, match="verdict"):
        await ledger.late_response("run-w/late", cast(Any, "yes"))


async def test_a_run_that_fails_with_terminal_escapes_stores_none_of_them(
    ledger: stopline.Ledger,
) -> None:
    """The reason of a run's ``fail`` event was its exception's message as it came: an
    ESC sequence in it reached the terminal of whoever ran ``stopline show``."""
    with pytest.raises(ValueError, match="cleared"):
        async with ledger.run("job", owner="user:1", run_id="run-esc"):
            raise ValueError("\x1b]0;title\x07\x1b[2Jcleared")
    (failed,) = [e for e in await ledger.backend.events("run-esc") if e.kind == "fail"]
    assert failed.data["reason"] == "ValueError: \ufffd]0;title\ufffd\ufffd[2Jcleared"


@pytest.mark.parametrize(
    "name", ["a\x00b", "a\udc80b", "x" * 5000], ids=["nul", "surrogate", "long"]
)
async def test_a_tool_name_that_cannot_be_stored_is_refused_before_the_gate(
    ledger: stopline.Ledger, name: str
) -> None:
    provider = FakeProvider("send")
    async with ledger.run("job", owner="user:1", run_id="run-name") as run:
        with pytest.raises(InvalidInput) as refused:
            await run.call(stopline.Tool(provider.tool.fn, name=name), 1, key="k")
    assert refused.value.what == "tool"
    assert await ledger.backend.operations("run-name") == [] and provider.requests == []


@pytest.mark.parametrize("bad", [math.nan, -1.0, "5", True], ids=["nan", "negative", "str", "bool"])
async def test_a_timeout_that_is_no_wait_is_refused_before_the_gate(
    ledger: stopline.Ledger, bad: Any
) -> None:
    """A NaN or a string reached the call's deadline after its intent was durable: the
    call never left, and its operation was recorded ``unknown`` (the receipt said
    "verifying"). Refused before the gate now, as every wait of the API is."""
    provider = FakeProvider("send")
    async with ledger.run("job", owner="user:1", run_id="run-timeout") as run:
        with pytest.raises(InvalidInput) as refused:
            await run.call(provider.tool, 1, key="k", timeout=bad)
        assert refused.value.what == "timeout"
        assert await ledger.backend.operations("run-timeout") == []
        assert provider.requests == []
        assert await run.call(provider.tool, 1, key="k", timeout=math.inf) is not None
    with pytest.raises(InvalidInput, match="timeout"):
        await ledger.wait_settled("run-timeout", timeout=bad)
    receipt = await ledger.wait_settled("run-timeout", timeout=10)
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]


async def test_the_apis_other_waits_and_limits_are_refused_naming_them(
    ledger: stopline.Ledger,
) -> None:
    """``approve(ttl=nan)`` granted an approval no gate could use (``-1``: expired when
    made) and ``ttl="x"`` failed with a ``TypeError``; ``reconcile`` took a NaN or a
    string ``accepted_after`` and a limit of -1 (no limit on SQLite) or past 64 bits
    (``OverflowError``); ``wait_for_change(poll=nan)`` raised anyio's ``ValueError``.
    Each is ``InvalidInput`` naming it, and nothing is decided."""
    async with ledger.run("job", owner="user:1", run_id="run-waits") as run:
        asked = await run.request_approval("k", approver="boss")
    bad_ttls: tuple[Any, ...] = (math.nan, -1.0, "x")
    for ttl in bad_ttls:
        with pytest.raises(InvalidInput) as refused:
            await ledger.approve(asked.id, by="boss", ttl=ttl)
        assert refused.value.what == "ttl"
    [approval] = await ledger.backend.approvals("run-waits")
    assert approval.status is stopline.ApprovalStatus.PENDING
    bad_passes: list[tuple[dict[str, Any], str]] = [
        ({"accepted_after": math.nan}, "accepted_after"),
        ({"accepted_after": "x"}, "accepted_after"),
        ({"limit": -1}, "limit"),
        ({"limit": 2**64}, "limit"),
    ]
    for options, what in bad_passes:
        with pytest.raises(InvalidInput) as refused:
            await ledger.reconcile(**options)
        assert refused.value.what == what
    with pytest.raises(InvalidInput, match="poll"):
        await ledger.wait_for_change("run-waits", poll=math.nan)
    with pytest.raises(InvalidInput, match="cancel_answer_timeout"):
        ledger.cancel_answer_timeout = math.nan  # read by the settler, in a cancel's follow-up
    assert ledger.cancel_answer_timeout >= 0
    granted = await ledger.approve(asked.id, by="boss", ttl=math.inf)
    assert granted.status is stopline.ApprovalStatus.GRANTED


@pytest.mark.parametrize(
    ("budget", "what"),
    [({"attempts": 0}, "attempts"), ({"first_delay": math.nan}, "first_delay")],
)
def test_a_verify_budget_that_cannot_wait_is_refused_when_made(
    budget: dict[str, Any], what: str
) -> None:
    with pytest.raises(InvalidInput) as refused:
        stopline.VerifyBudget(**budget)
    assert refused.value.what == what


@pytest.mark.parametrize(
    ("options", "what"),
    [
        ({"attempts": 0}, "attempts"),
        ({"attempts": "3"}, "attempts"),
        ({"backoff": math.nan}, "backoff"),
        ({"backoff": -1.0}, "backoff"),
        ({"factor": math.nan}, "factor"),
        ({"max_backoff": -5}, "max_backoff"),
    ],
)
def test_a_retry_that_cannot_wait_between_attempts_is_refused_when_made(
    options: dict[str, Any], what: str
) -> None:
    """A NaN or negative backoff failed between two attempts (the first one past the
    gate, refused, then ``anyio.sleep(nan)``); ``attempts=0`` made one attempt."""
    with pytest.raises(InvalidInput) as refused:
        stopline.Retry(**options)
    assert refused.value.what == what


async def test_a_retry_that_is_not_a_retry_is_refused_before_the_gate(
    ledger: stopline.Ledger,
) -> None:
    provider = FakeProvider("send")
    async with ledger.run("job", owner="user:1", run_id="run-retry") as run:
        with pytest.raises(InvalidInput, match=r"stopline\.Retry, not int") as refused:
            await run.call(provider.tool, 1, key="k", retry=3)  # type: ignore[arg-type]
    assert refused.value.what == "retry"
    assert await ledger.backend.operations("run-retry") == []


def test_an_mcp_clients_waits_are_checked_when_it_is_made() -> None:
    """``StoplineMCP``'s waits (and an MCP call's ``idle_timeout``, through the same
    rule) are refused when given, not in a call after its gate."""
    from stopline.integrations._renamed import renamed_idle_timeout
    from stopline.integrations.mcp import StoplineMCP

    for option in ("progress_cap", "settle_timeout", "poll_wait", "connect_timeout"):
        options: dict[str, Any] = {option: math.nan}
        with pytest.raises(InvalidInput) as refused:
            StoplineMCP("http://127.0.0.1:1/mcp", **options)
        assert refused.value.what == option
    with pytest.raises(InvalidInput, match="idle_timeout"):
        renamed_idle_timeout("StoplineMCP.call", -1.0, None)
    assert renamed_idle_timeout("StoplineMCP.call", 5, None) == 5.0


DIGEST = (
    "import enum, sys; from stopline.domain.model import args_digest\n"
    "class Colour(enum.Enum):\n    RED = 'red'\n"
    "print(args_digest([[{'b', 'a', 'c'}, frozenset({3, 1}), (1, 2), Colour.RED], {'k': {'x'}}]))"
)


def test_argument_digests_are_equal_across_processes() -> None:
    """Sets hash differently in every process (PYTHONHASHSEED): their digest does not."""
    outs = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", DIGEST], env=env, capture_output=True, text=True, check=True
        )
        outs.add(done.stdout.strip())
    assert len(outs) == 1


def test_a_key_that_is_not_text_keeps_its_type_in_the_digest() -> None:
    """``{1: x}`` is not ``{"1": x}``, and ``{1: x, "1": y}`` keeps both values: the
    digest wrote every key as text, so such arguments had one digest (ADR 0110)."""
    from stopline.domain.model import args_digest

    assert args_digest({1: "a"}) != args_digest({"1": "a"})
    assert args_digest({1: "a", "1": "b"}) != args_digest({1: "b", "1": "a"})
    assert args_digest({(1, 2): "a"}) != args_digest({"[1, 2]": "a"})
    # equal arguments, whatever their order: equal digests
    assert args_digest({2: "b", 1: "a"}) == args_digest({1: "a", 2: "b"})
    assert args_digest({"x": {1: "a"}}) == args_digest({"x": {1: "a"}})


async def test_a_repeat_whose_keys_differ_in_type_is_not_replayed(
    ledger: stopline.Ledger,
) -> None:
    """A call under a key, repeated with arguments that differ only in a key's type, is
    another call: refused (``IdempotencyConflict``), not answered with the first's
    result."""
    provider = FakeProvider("send")
    async with ledger.run("job", owner="user:1", run_id="run-keys") as run:
        await run.call(provider.tool, {1: "refund"}, key="k")
        with pytest.raises(stopline.IdempotencyConflict):
            await run.call(provider.tool, {"1": "refund"}, key="k")
    assert len(provider.requests) == 1


async def test_an_argument_without_a_stable_form_is_refused_at_call_time(
    ledger: stopline.Ledger,
) -> None:
    """Without a key its operation would be named by nothing stable: refused. Named by
    a key (a DBOS step's, a queue message's), its arguments are not compared: a step
    taking a client object was refused even with the key that names it."""
    provider = FakeProvider("send")
    async with ledger.run("job", owner="user:1", run_id="run-obj") as run:
        with pytest.raises(InvalidInput, match="memory") as refused:
            await run.call(provider.tool, object())
        assert refused.value.what == "arguments"
        assert provider.requests == [] and await ledger.backend.operations("run-obj") == []
        sent: list[str] = []

        async def send(ctx: stopline.CallContext, client: object) -> str:
            sent.append(ctx.key)
            return "sent"

        tool = stopline.Tool(send)
        assert await run.call(tool, object(), key="k") == "sent"
        assert await run.call(tool, object(), key="k") == "sent"  # replayed, not sent
    op = await ledger.backend.get_operation("run-obj/k")
    assert op.args_digest == "unstable:args[0][0]" and sent == ["run-obj/k"]


async def test_stopline_options_cannot_collide_with_a_tool_argument(
    ledger: stopline.Ledger,
) -> None:
    seen: list[dict[str, Any]] = []

    @stopline.tool
    async def set_flag(ctx: stopline.CallContext, key: str, value: int) -> str:
        seen.append({"op": ctx.key, "key": key, "value": value})
        return "ok"

    async with ledger.run("job", owner="user:1", run_id="run-opt") as run:
        with pytest.raises(InvalidInput) as refused:
            await run.call(set_flag, key="user:7", value=1)
        assert refused.value.what == "key"
        assert await ledger.backend.operations("run-opt") == []  # nothing passed the gate
        # the tool's arguments apart from stopline's options
        await run.call_with(set_flag, kwargs={"key": "user:7", "value": 1}, key="flag")
    assert seen == [{"op": "run-opt/flag", "key": "user:7", "value": 1}]
    op = await ledger.backend.get_operation("run-opt/flag")
    assert op.status is OpStatus.COMMITTED


async def test_r14_entering_a_run_that_has_ended_says_what_to_do(
    ledger: stopline.Ledger,
) -> None:
    async with ledger.run("job", owner="user:1", run_id="run-done"):
        pass
    with pytest.raises(RunEnded, match="would send every action again"):
        async with ledger.run("job", owner="user:1", run_id="run-done"):
            pass
    async with ledger.run("job", owner="user:1", run_id="run-stopped") as run:
        await ledger.cancel(run.id, by="user:1")
    await ledger.wait_settled("run-stopped", timeout=10)
    with pytest.raises(RunEnded, match=r"ledger\.resume"):
        async with ledger.run("job", owner="user:1", run_id="run-stopped"):
            pass


async def test_r14_resuming_a_run_in_review_says_what_to_do(ledger: stopline.Ledger) -> None:
    blind = FakeProvider("notify", cancellable=stopline.Cancellable.NEVER, verifiable=False)
    held = blind.hold("committed")

    async def body() -> None:
        async with (
            ledger.run("job", owner="user:1", run_id="run-review") as run,
            run.phase(stopline.PhaseKind.READING, stopline.Policy.IMMEDIATE),
        ):
            await run.call(blind.tool, 1, key="n")

    async with anyio.create_task_group() as tg:
        tg.start_soon(body)
        await held.reached.wait()
        await ledger.cancel("run-review", by="user:1")
    await ledger.wait_settled("run-review", timeout=10)
    with pytest.raises(RunEnded, match="resolve its review items"):
        await ledger.resume("run-review", by="user:1")


def test_a_tool_is_an_async_function_refused_otherwise_when_it_is_made() -> None:
    """A plain ``def`` (or an async generator) was accepted as a tool: called after the
    gate, its effect ran, then awaiting its answer raised a bare ``TypeError`` and the
    operation stayed in doubt. It is refused when the tool is made, nothing recorded."""
    ran: list[str] = []

    def send(text: str) -> str:
        ran.append(text)
        return "sent"

    async def stream(text: str) -> AsyncIterator[str]:
        yield text

    with pytest.raises(InvalidInput, match="'send' is a plain function"):
        stopline.tool(send)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="'stream' is an async generator"):
        stopline.Tool(stream)  # type: ignore[arg-type]
    assert not ran
