"""What the second engines probe found on a real Temporal dev server (P1, P3, P4).

P1 (R13): a tool's declared ``settles_within`` is recorded with its cut call's
``unknown``, so the receipt says until when (it held only in the worker's
memory, and the receipt said "verifying" with no end). P3: a stopline cancel
committed while the Temporal service is down reaches the workflow once the
service is back (it was asked once, the failure swallowed, and the workflow
stayed running in Temporal while its run said cancelled). P4:
``temporal.cancel`` with the service down fences the run it knows before it
raises Temporal's error (it raised first: the user's stop was not recorded).
The servers of P3 and P4 are their own, persisted to a file, killed with
SIGKILL and started again on the same port. Barriers, no sleeps.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
import temporalio.client
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.service import RetryConfig, RPCError, RPCStatusCode

import stopline
from stopline import Headline, OpStatus, RunState
from stopline.integrations import temporal
from stopline.integrations.temporal_server import TemporalDevServer, free_port, temporal_binary
from tests.conftest import FAST_VERIFY
from tests.engines.temporal_harness import Harness, harness
from tests.engines.temporal_workflows import Plan
from tests.engines.test_temporal_horizon import cut_on_the_wire


async def test_p1_r13_a_declared_horizon_is_recorded_and_the_receipt_says_until_when(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The tool declares ``settles_within=600`` (its provider commits up to ten minutes
    late). stopline's cancel cuts the activity after its request went out: the
    operation is ``unknown`` with that horizon recorded in the ledger, and the receipt
    says verifying until when; the effect lands, the read-back finds it: completed."""
    cut = await cut_on_the_wire(temporal_server, tmp_path, settles_within=600)
    op = cut.op
    assert op.status is OpStatus.UNKNOWN
    assert op.horizon is not None and op.horizon >= op.created_at + 600  # old: None
    assert cut.meanwhile.headline is Headline.VERIFYING
    assert " until " in cut.meanwhile.text()  # old: "verifying", no end said
    assert cut.remote.stored == cut.remote.received  # one request, landed once
    assert [line.status for line in cut.receipt.lines] == [OpStatus.COMMITTED]


class _SeesCancels(temporalio.client.Interceptor):
    """A barrier on the client's cancel requests: ``unanswered`` is set when every
    request made so far has failed unanswered (Temporal down)."""

    def __init__(self) -> None:
        self.started = 0
        self.failed = 0
        self.unanswered = anyio.Event()

    def intercept_client(
        self, next: temporalio.client.OutboundInterceptor
    ) -> temporalio.client.OutboundInterceptor:
        return _Seen(next, self)


class _Seen(temporalio.client.OutboundInterceptor):
    def __init__(self, next: temporalio.client.OutboundInterceptor, seen: _SeesCancels) -> None:
        super().__init__(next)
        self._seen = seen

    async def cancel_workflow(self, input: temporalio.client.CancelWorkflowInput) -> None:
        seen = self._seen
        seen.started += 1
        try:
            await self.next.cancel_workflow(input)
        except RPCError as exc:
            if exc.status is RPCStatusCode.UNAVAILABLE:
                seen.failed += 1
                if seen.failed == seen.started:
                    seen.unanswered.set()
            raise


class _AsksWhenFenced(temporalio.client.Interceptor):
    """Records, at each look-up or cancel a client sends, whether the run was fenced in
    the ledger then (``at_each``)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.ledger: stopline.Ledger | None = None  # the canceller's, once open
        self.at_each: list[tuple[str, bool]] = []

    async def note(self, rpc: str) -> None:
        if self.ledger is not None:
            run = await self.ledger.backend.get_run(self.run_id)
            self.at_each.append((rpc, run.state.fenced))

    def intercept_client(
        self, next: temporalio.client.OutboundInterceptor
    ) -> temporalio.client.OutboundInterceptor:
        return _Asked(next, self)


class _Asked(temporalio.client.OutboundInterceptor):
    def __init__(self, next: temporalio.client.OutboundInterceptor, seen: _AsksWhenFenced) -> None:
        super().__init__(next)
        self._seen = seen

    async def describe_workflow(
        self, input: temporalio.client.DescribeWorkflowInput
    ) -> temporalio.client.WorkflowExecutionDescription:
        await self._seen.note("describe")
        return await self.next.describe_workflow(input)

    async def cancel_workflow(self, input: temporalio.client.CancelWorkflowInput) -> None:
        await self._seen.note("cancel")
        await self.next.cancel_workflow(input)


class _Server:
    """A dev server of the test's own on a fixed port, its state in a file: killed
    (SIGKILL) and started again, it keeps its workflows."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.dev = TemporalDevServer("127.0.0.1", free_port(), free_port())
        self.proc: anyio.abc.Process | None = None

    async def start(self) -> None:
        cmd = [
            *(str(temporal_binary()), "server", "start-dev", "--headless", "--ip", "127.0.0.1"),
            *("--port", str(self.dev.port), "--http-port", str(self.dev.http_port)),
            *("--metrics-port", str(free_port()), "--log-level", "error"),
            *("--db-filename", str(self.db)),
        ]
        self.proc = await anyio.open_process(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        with anyio.fail_after(30):
            while True:  # no event says it is up: a client's connect is the probe
                assert self.proc.returncode is None, "the dev server exited"
                with contextlib.suppress(RuntimeError):
                    await Client.connect(self.dev.address)
                    return
                await anyio.sleep(0.1)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


# a client whose RPCs give up after ~1.5 s of retries with Temporal down: the default's
# 10 s was waited out by each look-up of these tests (their time, not what they show)
IMPATIENT = RetryConfig(max_elapsed_time_millis=1500)


async def impatient(server: _Server) -> Client:
    return await Client.connect(server.dev.address, retry_config=IMPATIENT)


@contextlib.asynccontextmanager
async def _own_server(tmp_path: Path) -> AsyncIterator[_Server]:
    server = _Server(tmp_path / "temporal.db")
    await server.start()
    try:
        yield server
    finally:
        with anyio.CancelScope(shield=True):
            await server.kill()


async def _opened(h: Harness, plan: Plan) -> WorkflowHandle[Any, Any]:
    """The workflow started, once it has opened its run."""
    handle = await h.start(plan)
    while handle.id not in {r.id for r in await h.ledger.backend.list_runs()}:
        await h.ledger.wait_for_change(handle.id)
    return handle


async def test_p3_a_stopline_cancel_during_a_temporal_outage_reaches_the_workflow(
    tmp_path: Path,
) -> None:
    """The workflow waits for a signal (no activity, no gate). The Temporal service is
    killed; the user presses stop: the run is fenced, the worker's requests to cancel
    the workflow go unanswered. Once the service is back the request is made again
    and the workflow ends cancelled; nothing was sent."""
    seen = _SeesCancels()
    async with _own_server(tmp_path) as server:
        client = await Client.connect(
            server.dev.address, interceptors=[seen], retry_config=IMPATIENT
        )
        async with harness(server.dev, tmp_path, client=client) as h:
            handle = await _opened(h, Plan(["upload"], wait_for_go=True))
            await server.kill()
            receipt = await h.ledger.cancel(handle.id, by="user:42", reason="pressed stop")
            await seen.unanswered.wait()  # each request the worker made went unanswered
            await server.start()
            with anyio.fail_after(30), pytest.raises(WorkflowFailureError):
                await handle.result()  # old: running for ever
            status = (await handle.describe()).status
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert status is WorkflowExecutionStatus.CANCELED
    assert h.provider.effects() == []


async def test_p4_temporal_cancel_with_the_service_down_fences_the_run_then_raises(
    tmp_path: Path,
) -> None:
    """``temporal.cancel`` from a process with no worker while Temporal is down: the
    workflow's run is fenced (the stop is recorded and every later gate refuses), then
    Temporal's own error is raised (its cancel was not requested)."""
    async with _own_server(tmp_path) as server:
        async with harness(server.dev, tmp_path, client=await impatient(server)) as h:
            handle = await _opened(h, Plan(["upload"], wait_for_go=True))
        await server.kill()
        async with stopline.open(h.ledger_url, verify=FAST_VERIFY) as elsewhere:
            with pytest.raises(RPCError) as raised:
                await temporal.cancel(elsewhere, h.client, handle.id, by="user:42")
            run = await elsewhere.backend.get_run(handle.id)
            receipt = await elsewhere.receipt(handle.id)
    assert raised.value.status is RPCStatusCode.UNAVAILABLE
    assert run.state is RunState.CANCELLED  # old: running, the stop not recorded
    assert receipt.cancelled_by == "user:42"
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert h.provider.effects() == []


async def test_a_temporal_cancel_fences_a_known_run_before_asking_temporal_anything(
    tmp_path: Path,
) -> None:
    """The ledger has the workflow's run, not ended: it is the run to fence, and it is
    fenced before the first request to Temporal leaves (Temporal down, the stop waited
    for a look-up's retries first: ~10 s with a default client)."""
    async with _own_server(tmp_path) as server:
        async with harness(server.dev, tmp_path, client=await impatient(server)) as h:
            handle = await _opened(h, Plan(["upload"], wait_for_go=True))
        asked = _AsksWhenFenced(handle.id)
        client = await Client.connect(
            server.dev.address, retry_config=IMPATIENT, interceptors=[asked]
        )
        await server.kill()
        async with stopline.open(h.ledger_url, verify=FAST_VERIFY) as elsewhere:
            asked.ledger = elsewhere
            with pytest.raises(RPCError):
                await temporal.cancel(elsewhere, client, handle.id, by="user:42")
    assert asked.at_each and all(fenced for _rpc, fenced in asked.at_each), asked.at_each
    assert h.provider.effects() == []


async def test_p4_temporal_cancel_with_the_service_down_and_no_run_changes_nothing(
    tmp_path: Path,
) -> None:
    """Temporal down and no run in the ledger for the id: which run, Temporal alone can
    say; Temporal's error is raised and the ledger is left as it was."""
    async with _own_server(tmp_path) as server:
        client = await impatient(server)
        await server.kill()
        async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
            with pytest.raises(RPCError) as raised:
                await temporal.cancel(ledger, client, "wf-nobody-knows", by="user:42")
            runs = await ledger.backend.list_runs()
    assert raised.value.status is RPCStatusCode.UNAVAILABLE
    assert runs == []
