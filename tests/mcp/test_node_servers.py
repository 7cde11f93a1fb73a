"""stopline's MCP client in front of the TypeScript SDK's reference servers, real, over
real stdio: ``@modelcontextprotocol/server-filesystem`` (real file effects, read back
with its own ``read_text_file``) and ``@modelcontextprotocol/server-everything`` (a
long-running tool with progress). They are pinned in ``tests/mcp/node``
(``package-lock.json``); ``make test`` installs them with ``npm ci``, so nothing here
needs the network.

Neither server knows stopline: no key is read, no cancel is answered (the SDK drops a
cancelled request's answer), a refusal is a result with ``isError: true``. Calls are
held in flight by the filesystem itself: ``edit_file`` on a named pipe reads it, and the
read waits for a writer; this test opening the pipe for writing is the barrier that the
server's call is in flight (no sleeps).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from mcp import StdioServerParameters
from stopline import Cause, Headline, OpStatus, PhaseKind, Policy
from stopline.domain.model import EventRecord
from stopline.integrations.mcp import StoplineMCP, ToolPolicy, UnknownTool

NODE = shutil.which("node")
PACKAGES = Path(__file__).resolve().parent / "node" / "node_modules" / "@modelcontextprotocol"
FILESYSTEM = PACKAGES / "server-filesystem" / "dist" / "index.js"
EVERYTHING = PACKAGES / "server-everything" / "dist" / "index.js"
READS = ("read_text_file", "get_file_info", "list_directory")

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(NODE is None, reason="the TypeScript reference servers need node"),
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def node_server(script: Path, *args: str) -> StdioServerParameters:
    if not script.exists():  # node is here: the servers must be too (never a skip)
        pytest.fail(f"{script} is missing: run `make tests/mcp/node/node_modules/.installed`")
    assert NODE is not None
    return StdioServerParameters(command=NODE, args=[str(script), *args])


class Files:
    """The filesystem server's root and what each keyed call is meant to leave there:
    its verifier reads the destination back through the server, as a user's would."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.meant: dict[str, tuple[Path, str]] = {}  # operation id -> (path, content)
        self.sent: list[str] = []  # the key of each tools/call written, in order

    def verifier(self, conn: StoplineMCP) -> stopline.Verifier:
        async def verify(ctx: stopline.CallContext) -> stopline.ReadBack:
            path, content = self.meant[ctx.key]
            ref = f"file:{path}"
            info = await conn.client.call_tool("get_file_info", {"path": str(path)})
            text = str(text_of(info.structured_content))
            # absent (or out of the server's reach: it cannot have written there), or
            # still the pipe: the edit never replaced it
            if info.is_error or "isFile: true" not in text:
                return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, ref=ref, detail=text)
            read = await conn.client.call_tool("read_text_file", {"path": str(path)})
            found = text_of(read.structured_content)
            if read.is_error or found is None:
                return stopline.ReadBack(stopline.Verdict.UNKNOWN, ref=ref, detail="unreadable")
            if found == content:
                return stopline.ReadBack(stopline.Verdict.COMMITTED, ref=ref, result=found)
            return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, ref=ref, detail=found)

        return verify

    def pipe(self, name: str) -> Path:
        path = self.root / name
        os.mkfifo(path)
        return path


def text_of(structured: Any) -> str | None:
    """The filesystem server's structured answer: ``{"content": text}``."""
    return structured.get("content") if isinstance(structured, dict) else None


@contextlib.asynccontextmanager
async def filesystem(files: Files, settles_within: float = 30.0) -> AsyncIterator[StoplineMCP]:
    policies = {name: ToolPolicy(effects=False) for name in READS}
    for name in ("write_file", "edit_file", "move_file"):
        policies[name] = ToolPolicy(settles_within=settles_within)
    target = node_server(FILESYSTEM, str(files.root))
    conn = StoplineMCP(target, name="fs", policies=policies)
    conn.verifiers = {name: files.verifier(conn) for name in ("write_file", "edit_file")}
    conn.on_request = lambda key, _id: files.sent.append(key)
    async with conn:
        yield conn


@pytest.fixture
def files(tmp_path: Path) -> Files:
    root = tmp_path / "root"
    root.mkdir()
    return Files(root.resolve())


async def writer_of(pipe: Path) -> int:
    """Open ``pipe`` for writing: this returns once the server opened it to read (the
    barrier that its call is in flight)."""
    return await anyio.to_thread.run_sync(os.open, str(pipe), os.O_WRONLY, abandon_on_cancel=True)


async def feed(fd: int, text: str) -> None:
    """What the server's read of the pipe gets; closing it ends that read."""
    await anyio.to_thread.run_sync(os.write, fd, text.encode())
    os.close(fd)


def pid_serving(root: Path) -> int:
    """The filesystem server process serving ``root`` (this test started it: its root is
    this test's own directory)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if str(FILESYSTEM).encode() in argv and str(root).encode() in argv:
                return int(entry.name)
    raise AssertionError(f"no server process serves {root}")


async def test_a_keyed_write_file_is_committed_and_on_disk(
    ledger: stopline.Ledger, files: Files
) -> None:
    folder = files.root / "q3"
    path = folder / "report.txt"
    async with (
        filesystem(files) as fs,
        ledger.run("report", owner="user:1") as run,
        run.phase(PhaseKind.CALLING_EXTERNAL),
    ):
        await fs.call(run, "create_directory", {"path": str(folder)}, key="folder")
        result = await fs.call(
            run, "write_file", {"path": str(path), "content": "Q3 report"}, key="report"
        )
        back = await fs.call(run, "read_text_file", {"path": str(path)})
    assert result == {"content": f"Successfully wrote to {path}"}
    assert back == {"content": "Q3 report"}
    assert path.read_text() == "Q3 report"
    receipt = await ledger.wait_settled(run.id, timeout=20)
    assert receipt.headline is Headline.COMPLETED
    ops = await ledger.backend.operations(run.id)  # the read is no operation
    assert [(op.id, op.status, op.tool) for op in ops] == [
        (f"{run.id}/folder", OpStatus.COMMITTED, "fs/create_directory"),
        (f"{run.id}/report", OpStatus.COMMITTED, "fs/write_file"),
    ]
    assert all(op.evidence[0].ref == "gate" for op in ops)  # durable intent before the send
    assert files.sent == [f"{run.id}/folder", f"{run.id}/report"]


async def cancel_edit_in_flight(
    ledger: stopline.Ledger, files: Files, fs: StoplineMCP, pipe: Path, fed: str
) -> tuple[stopline.Receipt, stopline.OperationRecord]:
    """An ``edit_file`` of ``pipe`` ("draft" -> "final") cancelled while the server reads
    the pipe; then the pipe gets ``fed``: the edit lands only if that holds "draft"."""
    run_id = f"edit-{pipe.name}"
    files.meant[f"{run_id}/edit"] = (pipe, "the final\n")
    edit = {"path": str(pipe), "edits": [{"oldText": "draft", "newText": "final"}]}

    async def workflow() -> None:
        async with (
            ledger.run("edit", owner="user:1", run_id=run_id) as run,
            run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),
        ):
            await fs.call(run, "edit_file", edit, key="edit")

    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow)
        fd = await writer_of(pipe)  # the server is reading: the call is in flight
        at_cancel = await ledger.cancel(run_id, by="user:1")
        assert at_cancel.lines[0].status is OpStatus.UNKNOWN
        await feed(fd, fed)
    receipt = await ledger.wait_settled(run_id, timeout=30)
    return receipt, (await ledger.backend.operations(run_id))[0]


async def test_a_cancel_in_flight_is_asked_and_the_edit_read_back_committed(
    ledger: stopline.Ledger, files: Files
) -> None:
    """The server finishes the edit after the cancel and sends no answer (its SDK drops
    a cancelled request's): reading the file back proves the commit."""
    pipe = files.pipe("draft.txt")
    async with filesystem(files) as fs:
        receipt, op = await cancel_edit_in_flight(ledger, files, fs, pipe, "the draft\n")
    assert pipe.read_text() == "the final\n"
    assert (op.status, op.cause, op.cancel_state) == (
        OpStatus.COMMITTED,
        Cause.USER_CANCEL,
        stopline.CancelState.ASKED,  # no MCP server answers a notifications/cancelled
    )
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    line = receipt.lines[0]
    assert line.provider_cancel == "cancel asked; no answer from the provider"
    # each word of the line rests on the evidence: the gate, the lost answer, the read
    assert [e.ref for e in line.evidence] == ["gate", "user_cancel", "horizon", f"file:{pipe}"]
    assert line.evidence[-1].kind is stopline.EvidenceKind.READ_BACK
    assert op.result == "the final\n"  # what the read found, the workflow's replay value


async def test_a_cancel_in_flight_whose_edit_never_lands_is_read_back_not_committed(
    ledger: stopline.Ledger, files: Files
) -> None:
    """The pipe holds no "draft": the server's edit fails, unanswered; the read-back
    finds the file unchanged, which proves "not committed" once the horizon passed."""
    pipe = files.pipe("other.txt")
    async with filesystem(files, settles_within=0.5) as fs:
        receipt, op = await cancel_edit_in_flight(ledger, files, fs, pipe, "no match\n")
    assert (op.status, op.cause) == (OpStatus.NOT_COMMITTED, Cause.USER_CANCEL)
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert receipt.lines[0].provider_cancel == "cancel asked; no answer from the provider"
    assert [e.ref for e in op.evidence][-1] == f"file:{pipe}"
    assert pipe.is_fifo()  # the edit never replaced it


async def test_a_resumed_run_replays_the_move_and_sends_it_once(
    ledger: stopline.Ledger, files: Files
) -> None:
    """S6 against a server with no idempotency of its own: ``move_file`` fails if sent
    twice (the source is gone, the destination exists). The resumed run's move is the
    ledger's replay; only the step after the cancel is sent."""
    source, moved, notes = files.root / "a.txt", files.root / "b.txt", files.root / "notes.txt"
    source.write_text("A")
    move = {"source": str(source), "destination": str(moved)}
    note = {"path": str(notes), "content": "moved"}
    run_id = "resume-move"
    async with filesystem(files) as fs:
        async with ledger.run("move", owner="user:1", run_id=run_id) as run:
            first = await fs.call(run, "move_file", move, key="move")
            mtime = moved.stat().st_mtime_ns
            await ledger.cancel(run_id, by="user:1")
            with pytest.raises(stopline.RunFenced):
                await fs.call(run, "write_file", note, key="note")
        receipt = await ledger.wait_settled(run_id, timeout=20)
        assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.PREVENTED]
        await ledger.resume(run_id, by="user:1")
        async with ledger.run("move", owner="user:1", run_id=run_id) as run:
            again = await fs.call(run, "move_file", move, key="move")
            await fs.call(run, "write_file", note, key="note")
    assert again == first == {"content": f"Successfully moved {source} to {moved}"}
    assert files.sent == [f"{run_id}/move", f"{run_id}/note"]  # the move went out once
    assert (source.exists(), moved.read_text(), moved.stat().st_mtime_ns) == (False, "A", mtime)
    assert notes.read_text() == "moved"


async def test_a_tool_the_server_does_not_list_is_refused_before_the_gate(
    ledger: stopline.Ledger, files: Files
) -> None:
    async with filesystem(files) as fs, ledger.run("odd", owner="user:1") as run:
        with pytest.raises(UnknownTool):
            await fs.call(run, "delete_file", {"path": str(files.root / "x")})
    assert await ledger.backend.operations(run.id) == []
    assert files.sent == []


async def test_arguments_the_listed_schema_refuses_are_refused_before_the_gate(
    ledger: stopline.Ledger, files: Files
) -> None:
    """The server validates arguments against the ``inputSchema`` it lists before its tool
    runs, and answers a misfit as a tool error (``isError: true``), which proves nothing:
    sent, it left an ``unknown`` write to read back. The client checks the listed schema
    first: ``InvalidInput``, nothing recorded or sent."""
    path = str(files.root / "x.txt")
    async with filesystem(files) as fs, ledger.run("odd", owner="user:1") as run:
        for arguments in ({"path": path}, {"path": path, "content": 7}, {"path": [path]}):
            with pytest.raises(stopline.InvalidInput, match="write_file"):
                await fs.call(run, "write_file", arguments)
        with pytest.raises(stopline.InvalidInput, match="edits/0: 'oldText' is a required"):
            await fs.call(run, "edit_file", {"path": path, "edits": [{"newText": "n"}]})
    assert await ledger.backend.operations(run.id) == []
    assert files.sent == []
    assert not (files.root / "x.txt").exists()


async def test_a_refusal_the_listing_cannot_foresee_is_read_back_not_committed(
    ledger: stopline.Ledger, files: Files, tmp_path: Path
) -> None:
    """A path outside the server's root fits the schema; the server refuses it as a tool
    error. That is ``NoAnswer`` (server_error), recorded ``unknown``, and the read-back
    of the destination settles it."""
    outside = tmp_path / "outside.txt"
    files.meant["outside/w"] = (outside, "x")
    async with filesystem(files, settles_within=0.2) as fs:
        async with ledger.run("odd", owner="user:1", run_id="outside") as run:
            with pytest.raises(stopline.NoAnswer, match="Access denied") as caught:
                await fs.call(run, "write_file", {"path": str(outside), "content": "x"}, key="w")
            assert caught.value.cause is Cause.SERVER_ERROR
        receipt = await ledger.wait_settled("outside", timeout=20)  # read back on `fs`
    assert [(line.status, line.evidence[-1].ref) for line in receipt.lines] == [
        (OpStatus.NOT_COMMITTED, f"file:{outside}")
    ]
    assert not outside.exists()


async def test_the_server_killed_mid_call_is_a_typed_error_and_read_back(
    ledger: stopline.Ledger, files: Files
) -> None:
    """The server process dies while it holds the edit: the call ends at once with
    ``NoAnswer`` (transport), nothing hangs; the read-back opens a new server process."""
    pipe = files.pipe("doc.txt")
    files.meant["killed/edit"] = (pipe, "the final\n")
    edit = {"path": str(pipe), "edits": [{"oldText": "draft", "newText": "final"}]}
    async with filesystem(files, settles_within=0.5) as fs:
        async with ledger.run("edit", owner="user:1", run_id="killed") as run:
            async with anyio.create_task_group() as tg:

                async def kill() -> None:
                    fd = await writer_of(pipe)
                    os.kill(pid_serving(files.root), signal.SIGKILL)
                    os.close(fd)

                tg.start_soon(kill)
                with pytest.raises(stopline.NoAnswer) as caught:
                    await fs.call(run, "edit_file", edit, key="edit")
            assert caught.value.cause is Cause.TRANSPORT
            (op,) = await ledger.backend.operations(run.id)
            assert (op.status, op.cause) == (OpStatus.UNKNOWN, Cause.TRANSPORT)
        receipt = await ledger.wait_settled("killed", timeout=30)
    # the read-back ran on a new server process: the pipe was never replaced
    assert fs.connections == 2
    assert [(line.status, line.evidence[-1].ref) for line in receipt.lines] == [
        (OpStatus.NOT_COMMITTED, f"file:{pipe}")
    ]
    assert pipe.is_fifo()


@contextlib.asynccontextmanager
async def everything(url: str | None = None, **options: Any) -> AsyncIterator[StoplineMCP]:
    """server-everything over stdio, or Streamable HTTP at ``url``. Its tools declare
    nothing of stopline's: every one, ``readOnlyHint`` or not, is gated (ADR 0055)."""
    target: StdioServerParameters | str = url or node_server(EVERYTHING, "stdio")
    async with StoplineMCP(target, mode="legacy", name="everything", **options) as conn:
        yield conn


async def events_of(ledger: stopline.Ledger, run_id: str, kind: str) -> list[EventRecord]:
    return [e for e in await ledger.backend.events(run_id) if e.kind == kind]


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_a_long_running_tool_reports_progress_and_its_cancel_is_asked(
    ledger: stopline.Ledger, transport: str, request: pytest.FixtureRequest
) -> None:
    """``trigger-long-running-operation`` reports progress at each step. Its progress is
    recorded (never a commit); a cut once it reported sends ``notifications/cancelled``,
    which the server takes silently: ``unknown`` (user_cancel), the cancel asked."""
    run_id, opened = "long", anyio.Event()
    slow = {"duration": 600, "steps": 6000}  # a step every 0.1 s, for longer than any test

    async def workflow() -> None:
        async with (
            ledger.run("long", owner="user:1", run_id=run_id) as run,
            run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),
        ):
            opened.set()
            await conn.call(run, "trigger-long-running-operation", slow, key="op")

    url = request.getfixturevalue("everything_http") if transport == "http" else None
    async with everything(url) as conn, anyio.create_task_group() as tg:
        tg.start_soon(workflow)
        await opened.wait()
        while not await events_of(ledger, run_id, "progress"):  # it is running
            await ledger.wait_for_change(run_id)
        at_cancel = await ledger.cancel(run_id, by="user:1")
        receipt = await ledger.wait_settled(run_id, timeout=20)
    assert at_cancel.lines[0].provider_cancel == "cancel asked; no answer from the provider"
    (op,) = await ledger.backend.operations(run_id)
    # nothing can read its effect back (no verifier, no stopline_verify): a reviewer's
    assert (op.status, op.cause, op.cancel_state) == (
        OpStatus.NEEDS_REVIEW,
        Cause.USER_CANCEL,
        stopline.CancelState.ASKED,
    )
    assert receipt.headline is Headline.NEEDS_REVIEW
    asked = await events_of(ledger, run_id, "cancel_asked")
    assert [e.data["channel"] for e in asked] == ["notifications/cancelled"]
    assert not await events_of(ledger, run_id, "committed")  # progress proved nothing


async def test_a_task_of_the_typescript_sdk_is_followed_and_cancelled_by_tasks_cancel(
    ledger: stopline.Ledger,
) -> None:
    """``simulate-research-query`` requires a task (2025-11-25): the client calls it as
    one, and a cancel goes by ``tasks/cancel``, whose answer (a status) is recorded as
    acknowledged: it says nothing of the work."""
    run_id, opened = "task", anyio.Event()

    async def workflow() -> None:
        async with (
            ledger.run("research", owner="user:1", run_id=run_id) as run,
            run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),
        ):
            opened.set()
            await conn.call(run, "simulate-research-query", {"topic": "tides"}, key="q")

    async with everything(tasks=True) as conn, anyio.create_task_group() as tg:
        tg.start_soon(workflow)
        await opened.wait()
        while not await events_of(ledger, run_id, "accepted"):  # the task exists
            await ledger.wait_for_change(run_id)
        await ledger.cancel(run_id, by="user:1")
        receipt = await ledger.wait_settled(run_id, timeout=20)
    (op,) = await ledger.backend.operations(run_id)
    assert op.evidence[1].ref.startswith("task:")  # accepted: the server created a task
    assert (op.status, op.cause, op.cancel_state) == (
        OpStatus.NEEDS_REVIEW,  # "cancelled" is the task's status, not the work's
        Cause.USER_CANCEL,
        stopline.CancelState.ACKNOWLEDGED,
    )
    asked = await events_of(ledger, run_id, "cancel_asked")
    assert [e.data["channel"] for e in asked] == ["tasks/cancel"]
    words = receipt.lines[0].provider_cancel
    assert words == "the provider acknowledged the cancel; that says nothing of the work"


@pytest.fixture(scope="module")
def everything_http() -> Iterator[str]:
    """server-everything over Streamable HTTP (its ``streamableHttp`` transport, on the
    port its ``PORT`` names). It binds the port itself: its line saying it listens is the
    barrier that it does."""
    assert NODE is not None
    with socket.socket() as sock:  # a free port; the server binds it again at once
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    drain: threading.Thread | None = None
    proc = subprocess.Popen(
        [NODE, str(node_server(EVERYTHING).args[0]), "streamableHttp"],
        env={**os.environ, "PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "listening on port" in line:
                break
        else:
            raise AssertionError(f"server-everything did not start (exit {proc.wait()})")
        drain = threading.Thread(target=proc.stderr.read)  # until it exits: never blocked
        drain.start()
        yield f"http://localhost:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)
        if drain is not None:
            drain.join()
        if proc.stderr is not None:
            proc.stderr.close()
