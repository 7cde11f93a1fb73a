"""A worker with the stopline plugin, its ledger and a provider with ground truth."""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
import threading
import uuid
import warnings
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from anyio.from_thread import BlockingPortal
from temporalio import activity
from temporalio.client import ActivityHandle, Client, WorkflowHandle
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

import stopline
from stopline.integrations.temporal import StoplinePlugin, call_context
from stopline.integrations.temporal_server import TemporalDevServer, temporal_dev_server
from tests.conftest import FAST_VERIFY
from tests.engines import subprocess_worker
from tests.engines.provider import FileProvider
from tests.engines.temporal_workflows import Chain, Pipeline, Plan, Updatable


def activities(provider: FileProvider) -> list[Any]:
    """``report`` reads; ``upload`` and ``notify`` touch the world through the provider."""

    @activity.defn(name="report")
    async def report(topic: str) -> str:
        return f"report: {topic}"

    @activity.defn(name="upload")
    async def upload(payload: str) -> dict[str, Any]:
        return await provider.send(call_context().key, payload)

    @activity.defn(name="notify")
    async def notify(payload: str) -> dict[str, Any]:
        return await provider.send(call_context().key, payload)

    return [report, upload, notify]


def plugin(
    ledger: stopline.Ledger,
    provider: FileProvider,
    acts: list[Any],
    *extra: stopline.Tool[Any],
    settles_within: float | None = 0.0,
) -> StoplinePlugin:
    """The plugin with the three activities' tools (their horizon ``settles_within``:
    ``None`` declares none, as a remote provider's tool may), and ``extra`` ones."""
    report, upload, notify = acts
    read: stopline.Tool[Any] = stopline.Tool(report, name="report", effects=False)
    tools = [
        read,
        provider.tool("upload", upload, "upload the report", settles_within),
        provider.tool("notify", notify, "notify the channel", settles_within),
        *extra,
    ]
    return StoplinePlugin(ledger, tools=tools, owner="user:42")


@dataclasses.dataclass
class Harness:
    client: Client
    ledger: stopline.Ledger
    provider: FileProvider
    task_queue: str
    ledger_url: str

    async def start(self, plan: Plan, workflow_id: str = "") -> WorkflowHandle[Any, Any]:
        return await self.client.start_workflow(
            Pipeline.run,
            plan,
            id=workflow_id or f"wf-{uuid.uuid4().hex[:12]}",
            task_queue=self.task_queue,
        )


@contextlib.asynccontextmanager
async def harness(
    server: TemporalDevServer,
    tmp_path: Path,
    *,
    worker: bool = True,
    watched: bool = True,
    client: Client | None = None,
    url: str = "",
) -> AsyncIterator[Harness]:
    """``watched=False``: the worker's ledger does not watch for cancels committed by
    other processes (``cancel_poll_ms=0``); they reach it at its next gate only.
    ``client``: the worker's, else one connected to ``server``. ``url``: the ledger's
    (a PostgreSQL schema of the test's), else an SQLite file in ``tmp_path``."""
    if client is None:
        client = await Client.connect(server.address, namespace=server.namespace)
    provider = FileProvider(tmp_path / "effects.jsonl")
    if not url:
        url = f"sqlite:///{tmp_path / 'ledger.db'}" + ("" if watched else "?cancel_poll_ms=0")
    queue = f"q-{uuid.uuid4().hex[:12]}"
    async with stopline.open(url, verify=FAST_VERIFY) as ledger:
        h = Harness(client, ledger, provider, queue, url)
        if not worker:
            yield h
            return
        async with worker_for(h):
            yield h


def worker_for(h: Harness, *extra: Any, tools: Sequence[stopline.Tool[Any]] = ()) -> Worker:
    """A worker on the harness's queue: its workflows, activities (and ``extra`` ones,
    with their ``tools``) and plugin, on its ledger."""
    acts = activities(h.provider)
    return Worker(
        h.client,
        task_queue=h.task_queue,
        workflows=[Pipeline, Chain, Updatable],
        activities=[*acts, *extra],
        plugins=[plugin(h.ledger, h.provider, acts, *tools)],
    )


def standalone_worker(h: Harness) -> Worker:
    """A worker for activities only (no workflow): a client starts them itself."""
    acts = activities(h.provider)
    return Worker(
        h.client,
        task_queue=h.task_queue,
        activities=acts,
        plugins=[plugin(h.ledger, h.provider, acts)],
    )


async def start_standalone(
    h: Harness,
    activity_id: str,
    payload: str = "the report",
    *,
    attempts: int = 0,
    timeout: float = 30,
) -> ActivityHandle[Any]:
    """``upload`` started by the client itself, no workflow (``attempts``: 0, unlimited;
    ``timeout``: its ``start_to_close_timeout``, seconds)."""
    return await h.client.start_activity(
        "upload",
        payload,
        id=activity_id,
        task_queue=h.task_queue,
        start_to_close_timeout=timedelta(seconds=timeout),
        heartbeat_timeout=timedelta(seconds=1),
        retry_policy=RetryPolicy(
            initial_interval=timedelta(milliseconds=50),
            backoff_coefficient=1.0,
            maximum_attempts=attempts,
        ),
    )


async def worker_process(
    server: TemporalDevServer, h: Harness, *mode: str
) -> subprocess_worker.Child:
    """A worker on the harness's queue and ledger in a process of its own
    (``temporal_worker``), polling: it holds every response once committed; with
    ``"remote"``, every call before any effect, its tools declaring no horizon."""
    child = await subprocess_worker.start(
        "tests.engines.temporal_worker",
        server.address,
        h.task_queue,
        h.ledger_url,
        str(h.provider.path),
        *mode,
    )
    try:
        await child.expect("ready")
    except BaseException:
        await child.kill()
        raise
    return child


async def killed_after_commit(
    server: TemporalDevServer, h: Harness, plan: Plan
) -> tuple[WorkflowHandle[Any, Any], str]:
    """The workflow started on a worker of a process of its own, SIGKILLed once its
    provider committed the first effect (before it answered): the handle and its key."""
    child = await worker_process(server, h)
    try:
        handle = await h.start(plan)
        committed = await child.expect("committed ")
    finally:
        await child.kill()
    return handle, committed.split(" ", 1)[1]


class TemporalSession:
    """The session's dev server, started on first use and again if it has died."""

    def __init__(self, portal: BlockingPortal) -> None:
        self._portal = portal
        self._stack = contextlib.ExitStack()
        self._server: TemporalDevServer | None = None
        self.restarts: list[str] = []  # what each dead server said

    def server(self) -> TemporalDevServer:
        if self._server is not None:
            said = self._server.exited()
            if said is None:
                return self._server
            self.restarts.append(said)
            warnings.warn(
                f"the session's Temporal dev server had died ({said}); starting another",
                stacklevel=2,
            )
            self._stack.close()  # its block ends (the process is gone already)
            self._stack = contextlib.ExitStack()
        self._server = self._stack.enter_context(
            self._portal.wrap_async_context_manager(temporal_dev_server())
        )
        return self._server

    def close(self) -> None:
        self._stack.close()


def hold_write_lock(path: Path, taken: threading.Event, release: threading.Event) -> None:
    """In a thread: another connection holds the SQLite file's write lock (``BEGIN
    IMMEDIATE``, as ``sqlite3`` at a prompt would) from ``taken`` until ``release``."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        taken.set()
        release.wait(60)
        conn.execute("ROLLBACK")
    finally:
        conn.close()
