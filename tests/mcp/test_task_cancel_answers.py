"""A task call's cancel, recorded as it happened, against a tasks server we did not write
(tests/mcp/raw_task_cancel_server.py: raw JSON-RPC, no SDK, nothing of stopline),
both eras, over real stdio and real Streamable HTTP.

A ``tools/call`` the server turned into a task is cancelled with ``tasks/cancel``:

- the record names that channel (before: ``notifications/cancelled`` or
  ``stream_close``, the channel of a call that is not a task);
- the server answers that ``tasks/cancel`` with a JSON-RPC error. The record and the
  receipt say the provider answered with an error, and what it said (before:
  "cancel asked; no answer from the provider", which is false), and claim nothing
  of the work from it: the task is still read until it says what the work did
  (here it finished: ``committed``, kept as the late answer, R4).

Both ways a cancel reaches a task call are covered: a cut (an ``immediate`` phase:
cutting the call's awaiting scope sends the ``tasks/cancel`` by itself) and an ask
(an ``at_boundary`` phase, the tool declared cancellable after acceptance: the
settler asks the client to cancel it).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

import stopline
from mcp import StdioServerParameters
from stopline import CancelState, OpStatus, PhaseKind, Policy
from stopline.domain.model import EventRecord
from stopline.domain.receipt import build_receipt
from stopline.domain.vocab import Cancellable
from stopline.integrations.mcp import StoplineMCP, ToolPolicy
from tests.conftest import FAST_VERIFY
from tests.domain.test_receipt import op as op_record
from tests.domain.test_receipt import run_record
from tests.mcp.conftest import ROOT, serve_http, server_env, wait_status

pytestmark = pytest.mark.timeout(60)

SERVER = "tests/mcp/raw_task_cancel_server.py"
ERAS = {"2025": "2025-11-25", "2026": "2026-07-28"}
CASES = ["stdio-2025", "stdio-2026", "http-2025", "http-2026"]
WORDS = "the cancel request ended in an error"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def truth(log: Path, event: str) -> list[str]:
    """The tasks the server logged ``event`` for (its ground truth)."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [e["task"] for e in map(json.loads, lines) if e["event"] == event]


Target = tuple[StdioServerParameters | str, str]


@pytest.fixture
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    """The server (``case``: transport and era; ``error``: its cancel's error) as a
    ``StoplineMCP`` target, with the client mode of its era."""
    kind, era = str(request.node.callspec.params["case"]).split("-")
    error = str(request.node.callspec.params.get("error", "terminal"))
    mode = "legacy" if era == "2025" else ERAS[era]
    args = [SERVER, ERAS[era], error, str(tmp_path / "truth.jsonl")]
    if kind == "stdio":
        params = StdioServerParameters(command=sys.executable, args=args, cwd=str(ROOT))
        params.env = server_env()
        yield params, mode
        return
    with serve_http(*args) as url:
        yield url, mode


def connect(target: Target, cancellable: Cancellable | None) -> StoplineMCP:
    server, mode = target
    policy = ToolPolicy(task=True, effects=True, cancellable=cancellable)
    return StoplineMCP(server, mode=mode, name="raw", tasks=True, policies={"upload": policy})


@pytest.fixture
async def ledger(tmp_path: Path) -> AsyncIterator[stopline.Ledger]:
    async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}", verify=FAST_VERIFY) as ledger:
        yield ledger


async def cancel_a_task(
    ledger: stopline.Ledger, target: Target, cancellable: Cancellable | None, policy: Policy
) -> tuple[stopline.OperationRecord, list[EventRecord], stopline.Receipt]:
    """One ``upload`` (a task at the server) in a ``policy`` phase, cancelled once the
    task exists; its operation once the follow-up has read the task's end, the run's
    events and its receipt."""

    async def workflow(run: stopline.Run) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, policy):
            await conn.call(run, "upload", {})

    async with connect(target, cancellable) as conn:
        async with ledger.run("upload", owner="user:1") as run, anyio.create_task_group() as tg:
            tg.start_soon(workflow, run)
            while not any(
                op.status is OpStatus.ACCEPTED for op in await ledger.backend.operations(run.id)
            ):
                await ledger.wait_for_change(run.id)
            await ledger.cancel(run.id, by="user:1")
        op = (await ledger.backend.operations(run.id))[0]
        # the follow-up reads the task until it says what the work did: it finished
        op = await wait_status(ledger, op.id, OpStatus.COMMITTED)
        receipt = await ledger.wait_settled(run.id, timeout=30)
    return op, await ledger.backend.events(run.id), receipt


def check_recorded(
    recorded: tuple[stopline.OperationRecord, list[EventRecord], stopline.Receipt], log: Path
) -> None:
    """What every case records: the channel taken, the answer as given, the work's end,
    and the receipt's words for the answer."""
    op, events, receipt = recorded
    channels = [e.data.get("channel") for e in events if e.kind == "cancel_asked"]
    # both at once: on the code before, the channel was the plain call's and the state
    # "asked" ("no answer from the provider")
    assert (channels, op.cancel_state.value) == (["tasks/cancel"], "error")
    assert op.cancel_state is CancelState.ERROR
    [answer] = [e for e in events if e.kind == "cancel_error"]
    assert answer.data["channel"] == "tasks/cancel"
    assert "t-1" in answer.data["detail"] and "-326" in answer.data["detail"]
    assert truth(log, "cancel") == ["t-1"]  # one tasks/cancel, for this call's task
    assert truth(log, "get") != []  # the task was read after its cancel's error
    assert truth(log, "effect") == ["t-1"]
    assert op.status is OpStatus.COMMITTED
    [line] = receipt.lines
    assert line.provider_cancel.startswith(WORDS)
    assert "no answer" not in receipt.text()


@pytest.mark.parametrize("case", CASES)
async def test_a_cut_task_calls_cancel_is_recorded_as_its_channel_answered(
    ledger: stopline.Ledger, target: Target, tmp_path: Path, case: str
) -> None:
    """Cut under ``immediate``: the cut sent ``tasks/cancel``; the server answered it with
    an error (the task was already completed)."""
    recorded = await cancel_a_task(ledger, target, None, Policy.IMMEDIATE)
    check_recorded(recorded, tmp_path / "truth.jsonl")


@pytest.mark.parametrize("error", ["terminal", "internal"])
@pytest.mark.parametrize("case", CASES)
async def test_an_asked_task_calls_cancel_is_recorded_as_its_channel_answered(
    ledger: stopline.Ledger, target: Target, tmp_path: Path, case: str, error: str
) -> None:
    """Asked under ``at_boundary`` (the tool cancellable after acceptance): the client
    sends ``tasks/cancel``, which the server answers with ``error``."""
    recorded = await cancel_a_task(ledger, target, Cancellable.AFTER_ACCEPTED, Policy.AT_BOUNDARY)
    check_recorded(recorded, tmp_path / "truth.jsonl")


@pytest.mark.parametrize("cancellable", list(Cancellable))
def test_an_error_answer_in_flight_promises_no_answer_to_wait_for(
    cancellable: Cancellable,
) -> None:
    """The record as the receipt reads it, before the call's own end is in (accepted,
    the cancel answered with an error): the line says the provider answered with an
    error, and its recovery neither waits for an answer already given nor says the
    work cannot stop (R14); the provider may still complete it: read it back."""
    record = op_record(OpStatus.ACCEPTED, cancellable=cancellable, cancel_state=CancelState.ERROR)
    [line] = build_receipt(run_record(), [record]).lines
    assert line.provider_cancel.startswith(WORDS)
    assert line.recovery == (
        "its provider may still complete it; then verify by reading the destination"
    )


@pytest.mark.parametrize("kind", ["stdio", "http"])
async def test_a_fastmcp_task_calls_acknowledged_cancel_names_tasks_cancel(
    ledger: stopline.Ledger, kind: str
) -> None:
    """Against FastMCP 4.1 with ``fastmcp-tasks`` (SEP-2663, an implementation we did not
    write): its ``stuck`` tool runs as a task until cancelled; the cut's ``tasks/cancel``
    is acknowledged. The record names ``tasks/cancel`` as the channel (before:
    ``notifications/cancelled`` on stdio, ``stream_close`` on HTTP), and the
    acknowledgement is recorded as one (it was ``asked``, "no answer from the
    provider"), saying nothing of the work (ADR 0083, amendment)."""
    server = ["-m", "tests.support.fastmcp_tasks_server"]
    with contextlib.ExitStack() as stack:
        target: StdioServerParameters | str
        if kind == "stdio":
            target = StdioServerParameters(
                command=sys.executable, args=server, cwd=str(ROOT), env=server_env()
            )
        else:
            target = stack.enter_context(serve_http(*server))
        async with StoplineMCP(target, mode="2026-07-28", name="fastmcp", tasks=True) as conn:
            async with ledger.run("stuck", owner="user:1") as run, anyio.create_task_group() as tg:

                async def stuck() -> None:
                    async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
                        await conn.call(run, "stuck", {"payload": "x"})

                tg.start_soon(stuck)
                while not any(
                    op.status is OpStatus.ACCEPTED for op in await ledger.backend.operations(run.id)
                ):
                    await ledger.wait_for_change(run.id)
                await ledger.cancel(run.id, by="user:1")
            receipt = await ledger.wait_settled(run.id, timeout=30)
            events = await ledger.backend.events(run.id)
    channels = [e.data.get("channel") for e in events if e.kind == "cancel_asked"]
    assert channels == ["tasks/cancel"]
    [requested] = [e for e in events if e.kind == "task_cancel_requested"]
    assert "acknowledged" in requested.data["detail"]
    op = (await ledger.backend.operations(run.id))[0]
    assert op.cancel_state is CancelState.ACKNOWLEDGED
    assert receipt.lines[0].provider_cancel == (
        "the provider acknowledged the cancel; that says nothing of the work"
    )
    [acknowledged] = [e for e in events if e.kind == "cancel_acknowledged"]
    assert acknowledged.data["channel"] == "tasks/cancel"
