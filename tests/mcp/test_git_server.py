"""stopline's MCP client in front of ``mcp-server-git`` (the Python reference server,
from PyPI, pinned in the ``dev`` extra), real, over real stdio, on a real git
repository made for each test. The server knows nothing of stopline: it reads no key,
answers no cancel (its tools run in a worker thread, which a cancel cannot stop), and
says a failure as a tool error.

A user's way in front of it: the server's read tools are declared reads; the writes
(``git_add``, ``git_commit``, ``git_create_branch``) are gated; a commit's message
carries the operation's key as a trailer (``Stopline-Key: <run id>/<key>``), and a
verifier reads ``git_log`` through the server and looks for it: that is the
reconciliation by reading the destination.

Calls are held in flight by git itself: GitPython runs the repository's
``pre-commit`` and ``post-commit`` hooks, and the test's hooks read a named pipe when
there is one; this test opening the pipe for writing is the barrier that the server's
commit is in flight (``pre-commit``: nothing written yet; ``post-commit``: the commit
is on disk, its answer not yet sent). What the pipe is fed decides the hook's exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from mcp import StdioServerParameters
from stopline import Cause, Headline, OpStatus, PhaseKind, Policy
from stopline.integrations.mcp import StoplineMCP, ToolPolicy

import mcp_server_git  # noqa: F401  # isort: skip  # the dev extra's; fails here when missing

READS = ["git_status", "git_diff_unstaged", "git_diff_staged", "git_diff", "git_log"]
READS += ["git_show", "git_branch"]
HOOK = """#!/bin/sh
hold="{git_dir}/hold-{name}"
[ -p "$hold" ] || exit 0
said=$(cat "$hold")
rm -f "$hold"
[ "$said" != abort ]
"""

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


class Repo:
    """A git repository with one commit and the holding hooks; read with git's CLI."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sent: list[str] = []  # the key of each tools/call written, in order

    def git(self, *args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(self.path), *args], check=True, capture_output=True, text=True
        )
        return done.stdout

    def commits(self) -> list[tuple[str, str]]:
        """Every commit reachable from HEAD, newest first: (sha, message)."""
        out = self.git("log", "--format=%H%x1f%B%x1e")
        return [tuple(e.strip().split("\x1f", 1)) for e in out.split("\x1e") if e.strip()]  # type: ignore[misc]

    def with_key(self, key: str) -> list[str]:
        """The shas of the commits whose message carries ``key``."""
        return [sha for sha, message in self.commits() if f"Stopline-Key: {key}" in message]

    def hold(self, hook: str) -> Path:
        """The pipe the ``hook`` reads on its next run (once)."""
        pipe = self.path / ".git" / f"hold-{hook}"
        os.mkfifo(pipe)
        return pipe

    def server(self) -> StdioServerParameters:
        args = ["-m", "mcp_server_git", "--repository", str(self.path)]
        return StdioServerParameters(command=sys.executable, args=args)

    def server_pid(self) -> int:
        """The server process serving this repository (this test started it)."""
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    argv = (entry / "cmdline").read_bytes().split(b"\0")
                    if b"mcp_server_git" in argv and str(self.path).encode() in argv:
                        return int(entry.name)
        raise AssertionError(f"no server process serves {self.path}")

    def stage(self, name: str, text: str) -> dict[str, Any]:
        (self.path / name).write_text(text)
        return {"repo_path": str(self.path), "files": [name]}

    def commit(self, run_id: str, key: str, title: str) -> dict[str, Any]:
        message = f"{title}\n\nStopline-Key: {run_id}/{key}\n"
        return {"repo_path": str(self.path), "message": message}


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    path = (tmp_path / "repo").resolve()
    path.mkdir()
    made = Repo(path)
    made.git("init", "-q", "-b", "main")
    made.git("config", "user.name", "Agent")
    made.git("config", "user.email", "agent@example.com")
    (path / "README").write_text("hello\n")
    made.git("add", "README")
    made.git("commit", "-q", "-m", "init")
    for name in ("pre-commit", "post-commit"):
        hook = path / ".git" / "hooks" / name
        hook.write_text(HOOK.format(git_dir=path / ".git", name=name))
        hook.chmod(0o755)
    return made


def text_of(result: Any) -> str:
    return "".join(getattr(block, "text", "") for block in result.content)


def commit_verifier(conn: StoplineMCP, repo: Repo) -> stopline.Verifier:
    """``git_commit``'s read-back, through the server's own ``git_log``: the commit whose
    message carries the operation's key, or none."""

    async def verify(ctx: stopline.CallContext) -> stopline.ReadBack:
        arguments = {"repo_path": str(repo.path), "max_count": 100}
        log = await conn.client.call_tool("git_log", arguments)
        if log.is_error:
            return stopline.ReadBack(stopline.Verdict.UNKNOWN, detail=text_of(log))
        for entry in text_of(log).split("Commit: ")[1:]:
            if f"Stopline-Key: {ctx.key}" in entry:
                sha = entry.split("\n", 1)[0]
                said = f"Changes committed successfully with hash {sha}"
                return stopline.ReadBack(stopline.Verdict.COMMITTED, ref=f"git:{sha}", result=said)
        # no commit carries the key: "not committed" once the horizon passed (R13)
        return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, ref="git_log")

    return verify


@contextlib.asynccontextmanager
async def git_server(
    repo: Repo, settles_within: float = 30.0, mode: str = "legacy", **options: Any
) -> AsyncIterator[StoplineMCP]:
    policies = {name: ToolPolicy(effects=False) for name in READS}
    policies["git_commit"] = ToolPolicy(settles_within=settles_within)
    conn = StoplineMCP(repo.server(), mode=mode, name="git", policies=policies, **options)
    conn.verifiers = {"git_commit": commit_verifier(conn, repo)}
    conn.on_request = lambda key, _id: repo.sent.append(key)
    async with conn:
        yield conn


async def writer_of(pipe: Path) -> int:
    """Open ``pipe`` for writing: this returns once the hook opened it to read (the
    barrier that the server's commit is in flight)."""
    return await anyio.to_thread.run_sync(os.open, str(pipe), os.O_WRONLY, abandon_on_cancel=True)


def feed(fd: int, word: str) -> None:
    """What the hook reads; closing the pipe ends its read (``abort``: it fails)."""
    os.write(fd, word.encode())
    os.close(fd)


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_gated_writes_are_committed_and_the_receipt_matches_the_repository(
    ledger: stopline.Ledger, repo: Repo, mode: str
) -> None:
    """Each write passes the gate, is sent once with its key and is recorded with what
    the server answered; each receipt line is what the repository shows."""
    run_id = "release"
    async with (
        git_server(repo, mode=mode) as git,
        ledger.run("release", owner="user:1", run_id=run_id) as run,
        run.phase(PhaseKind.COMMITTING),
    ):
        staged = await git.call(run, "git_add", repo.stage("notes.txt", "v1\n"), key="add")
        done = await git.call(
            run, "git_commit", repo.commit(run_id, "commit", "Notes"), key="commit"
        )
        where = {"repo_path": str(repo.path), "branch_name": "release-1"}
        branched = await git.call(run, "git_create_branch", where, key="branch")
        log = await git.call(run, "git_log", {"repo_path": str(repo.path), "max_count": 1})
    receipt = await ledger.wait_settled(run_id, timeout=20)
    head = repo.git("rev-parse", "HEAD").strip()
    assert staged == "Files staged successfully"
    assert done == f"Changes committed successfully with hash {head}"
    assert branched == "Created branch 'release-1' from 'main'"
    assert log.startswith(f"Commit history:\nCommit: {head}\n")  # a read: no operation
    assert receipt.headline is Headline.COMPLETED
    assert [(line.op_id, line.what, line.status) for line in receipt.lines] == [
        (f"{run_id}/add", "Adds file contents to the staging area", OpStatus.COMMITTED),
        (f"{run_id}/commit", "Records changes to the repository", OpStatus.COMMITTED),
        (
            f"{run_id}/branch",
            "Creates a new branch from an optional base branch",
            OpStatus.COMMITTED,
        ),
    ]
    assert all(line.evidence[0].ref == "gate" for line in receipt.lines)
    assert repo.sent == [f"{run_id}/add", f"{run_id}/commit", f"{run_id}/branch"]
    # what the repository shows: the one commit, holding the file, the branch at it
    assert [message for _, message in repo.commits()] == [
        f"Notes\n\nStopline-Key: {run_id}/commit",
        "init",
    ]
    assert repo.git("show", "HEAD:notes.txt") == "v1\n"
    assert repo.git("rev-parse", "release-1").strip() == head
    assert repo.git("status", "--porcelain") == ""


async def cancel_held_commit(
    ledger: stopline.Ledger, repo: Repo, git: StoplineMCP, run_id: str, word: str
) -> tuple[stopline.Receipt, stopline.Receipt, stopline.OperationRecord]:
    """``git_commit`` cancelled while its ``pre-commit`` hook holds it; the hook is then
    fed ``word`` (``abort``: the commit fails, else it lands)."""
    pipe = repo.hold("pre-commit")

    async def workflow() -> None:
        async with ledger.run("notes", owner="user:1", run_id=run_id) as run:
            await git.call(run, "git_add", repo.stage("notes.txt", "v2\n"), key="add")
            async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
                await git.call(
                    run, "git_commit", repo.commit(run_id, "commit", "Notes"), key="commit"
                )

    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow)
        fd = await writer_of(pipe)  # the server is in the hook: the commit is in flight
        at_cancel = await ledger.cancel(run_id, by="user:1")
        feed(fd, word)
    receipt = await ledger.wait_settled(run_id, timeout=30)
    return at_cancel, receipt, (await ledger.backend.operations(run_id))[1]


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_a_cancel_while_the_commit_is_held_is_asked_and_read_back_committed(
    ledger: stopline.Ledger, repo: Repo, mode: str
) -> None:
    """The server cannot stop its worker thread: the commit lands after the cancel and
    no answer comes. The receipt says ``unknown`` at the cancel, then what ``git_log``
    read back: committed, the very commit the repository holds."""
    async with git_server(repo, mode=mode) as git:
        at_cancel, receipt, op = await cancel_held_commit(ledger, repo, git, "held", "go")
        late = list(git.late)
    (sha,) = repo.with_key("held/commit")
    assert at_cancel.lines[1].status is OpStatus.UNKNOWN
    assert (op.status, op.cause, op.cancel_state) == (
        OpStatus.COMMITTED,
        Cause.USER_CANCEL,
        stopline.CancelState.ASKED,
    )
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    add, commit = receipt.lines
    assert (add.status, add.provider_cancel) == (OpStatus.COMMITTED, "")
    assert commit.provider_cancel == "cancel asked; no answer from the provider"
    assert [e.ref for e in commit.evidence] == ["gate", "user_cancel", "horizon", f"git:{sha}"]
    assert commit.evidence[-1].kind is stopline.EvidenceKind.READ_BACK
    assert op.result == f"Changes committed successfully with hash {sha}"
    assert late == []  # the SDK server drops a cancelled request's answer
    assert repo.commits()[0] == (sha, "Notes\n\nStopline-Key: held/commit")
    assert repo.git("show", f"{sha}:notes.txt") == "v2\n"


async def test_a_resumed_run_replays_the_commit_it_read_back_and_sends_it_once(
    ledger: stopline.Ledger, repo: Repo
) -> None:
    """The run cancelled while its commit was held, read back committed, then resumed
    and entered again under the same keys: ``git_add`` and ``git_commit`` are the
    ledger's replay (a second commit would fail: nothing is staged); only the branch
    after them is sent."""
    async with git_server(repo) as git:
        await cancel_held_commit(ledger, repo, git, "again", "go")
        (sha,) = repo.with_key("again/commit")
        await ledger.resume("again", by="user:1")
        where = {"repo_path": str(repo.path), "branch_name": "notes"}
        async with ledger.run("notes", owner="user:1", run_id="again") as run:
            added = await git.call(run, "git_add", repo.stage("notes.txt", "v2\n"), key="add")
            done = await git.call(
                run, "git_commit", repo.commit("again", "commit", "Notes"), key="commit"
            )
            await git.call(run, "git_create_branch", where, key="branch")
        receipt = await ledger.wait_settled("again", timeout=20)
    assert (added, done) == (
        "Files staged successfully",
        f"Changes committed successfully with hash {sha}",
    )
    assert repo.sent == ["again/add", "again/commit", "again/branch"]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED] * 3
    assert repo.with_key("again/commit") == [sha]
    assert repo.git("rev-parse", "notes").strip() == sha


async def test_the_horizon_the_tool_declares_holds_past_the_clients_own_wait(
    ledger: stopline.Ledger, repo: Repo
) -> None:
    """``git_commit`` may land up to 30 s after it was sent (``settles_within``); the
    client waits for an answer at most 0.5 s (``progress_cap``). A cancel does not stop
    the server's worker thread, so the commit may land after the client stopped
    waiting: the horizon is the tool's, and the commit landing after the client's wait
    is read back committed. Before, the client's wait was stated as the horizon, the
    earlier bound won, and a read-back that found nothing past 0.5 s proved "not
    committed" of a commit that then landed (seen: the receipt said so, and the
    repository held the commit)."""
    pipe, run_id, written = repo.hold("pre-commit"), "late", list[float]()

    async def on_disk(ctx: stopline.CallContext) -> stopline.ReadBack:
        """The repository read on disk (the server's ``git_log`` waits for the commit it
        holds: its tools run one at a time)."""
        shas = await anyio.to_thread.run_sync(repo.with_key, ctx.key)
        if shas:
            said = f"Changes committed successfully with hash {shas[0]}"
            return stopline.ReadBack(stopline.Verdict.COMMITTED, ref=f"git:{shas[0]}", result=said)
        return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, ref="git_log")

    async with git_server(repo, progress_cap=0.5) as git:
        git.verifiers["git_commit"] = on_disk
        sent = git.on_request
        assert sent is not None

        def on_request(key: str, request_id: Any) -> None:
            if key == "late/commit":
                written.append(time.time())  # after the call's start
            sent(key, request_id)

        git.on_request = on_request

        async def workflow() -> None:
            async with (
                ledger.run("notes", owner="user:1", run_id=run_id) as run,
                run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),
            ):
                await git.call(run, "git_add", repo.stage("notes.txt", "v4\n"), key="add")
                message = repo.commit(run_id, "commit", "Notes")
                await git.call(run, "git_commit", message, key="commit")

        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow)
            fd = await writer_of(pipe)  # in the hook: nothing written yet
            try:
                await ledger.cancel(run_id, by="user:1")
                while not (horizon := horizon_of(await ledger.backend.operations(run_id))):
                    await ledger.wait_for_change(run_id)
            finally:
                feed(fd, "go")  # the commit lands, after the client's wait
        receipt = await ledger.wait_settled(run_id, timeout=30)
    assert horizon >= written[0] + 29.0  # the tool's 30 s, not the client's 0.5 s
    (sha,) = repo.with_key("late/commit")
    commit = receipt.lines[1]
    assert (commit.status, commit.evidence[-1].ref) == (OpStatus.COMMITTED, f"git:{sha}")
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


def horizon_of(ops: list[stopline.OperationRecord]) -> float:
    """The horizon the commit's ``unknown`` was recorded with (0: not yet recorded)."""
    said = [e.detail for op in ops if op.id.endswith("/commit") for e in op.evidence]
    refs = [e.ref for op in ops if op.id.endswith("/commit") for e in op.evidence]
    return float(said[refs.index("horizon")]) if "horizon" in refs else 0.0


async def test_a_cancel_whose_commit_fails_is_read_back_not_committed(
    ledger: stopline.Ledger, repo: Repo
) -> None:
    """The hook fails the commit after the cancel: nothing carries the key in
    ``git_log``, which proves "not committed" once the horizon passed; the file is
    still staged, as the receipt's committed ``git_add`` says."""
    async with git_server(repo, settles_within=0.5) as git:
        _, receipt, op = await cancel_held_commit(ledger, repo, git, "aborted", "abort")
    assert (op.status, op.cause) == (OpStatus.NOT_COMMITTED, Cause.USER_CANCEL)
    assert [(line.status, line.evidence[-1].ref) for line in receipt.lines] == [
        (OpStatus.COMMITTED, receipt.lines[0].evidence[-1].ref),
        (OpStatus.NOT_COMMITTED, "git_log"),
    ]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert [message for _, message in repo.commits()] == ["init"]
    assert repo.git("diff", "--cached", "--name-only") == "notes.txt\n"


async def killed_in(
    ledger: stopline.Ledger, repo: Repo, git: StoplineMCP, run_id: str, hook: str
) -> Any:
    """``git_commit`` in flight, held in ``hook``, when the server process is killed
    (the hook is let go once the server is dead), called with a retry: what it returned."""
    pipe = repo.hold(hook)
    async with ledger.run("notes", owner="user:1", run_id=run_id) as run:
        await git.call(run, "git_add", repo.stage("notes.txt", "v3\n"), key="add")
        fds: list[int] = []

        async def kill() -> None:
            fds.append(await writer_of(pipe))
            os.kill(repo.server_pid(), signal.SIGKILL)
            feed(fds[0], "go")  # the orphaned hook ends; its server is gone

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill)
            message = repo.commit(run_id, "commit", "Notes")
            retry = stopline.Retry(attempts=2, backoff=0.05)
            return await git.call(run, "git_commit", message, key="commit", retry=retry)


async def test_killed_after_the_commit_landed_the_retry_reads_it_back_and_sends_nothing(
    ledger: stopline.Ledger, repo: Repo
) -> None:
    """Killed in ``post-commit``: the commit is on disk, its answer never sent. The
    attempt ends at once (``transport``); before the retry the runtime reads back (R5),
    on a new server process: ``git_log`` holds the key, so the retry returns what the
    read found and sends nothing. One such commit in the repository."""
    async with git_server(repo) as git:
        got = await killed_in(ledger, repo, git, "after", "post-commit")
        receipt = await ledger.wait_settled("after", timeout=30)
        assert git.connections == 2  # the read-back opened a new server process
    (sha,) = repo.with_key("after/commit")
    assert got == f"Changes committed successfully with hash {sha}"
    assert repo.sent == ["after/add", "after/commit"]  # the commit went out once
    assert receipt.headline is Headline.COMPLETED
    commit = receipt.lines[1]
    assert commit.status is OpStatus.COMMITTED
    assert [e.ref for e in commit.evidence] == ["gate", "transport", "horizon", f"git:{sha}"]
    assert commit.evidence[-1].kind is stopline.EvidenceKind.READ_BACK
    assert [message for _, message in repo.commits()] == [
        "Notes\n\nStopline-Key: after/commit",
        "init",
    ]


async def test_killed_before_the_commit_the_retry_reads_back_then_commits_once(
    ledger: stopline.Ledger, repo: Repo
) -> None:
    """Killed in ``pre-commit``: nothing was written. Before the retry the runtime reads
    back: no commit carries the key, which proves "not committed" once the horizon
    passed (0.5 s); then, and only then, the commit is sent again and lands once."""
    async with git_server(repo, settles_within=0.5) as git:
        got = await killed_in(ledger, repo, git, "before", "pre-commit")
        receipt = await ledger.wait_settled("before", timeout=30)
    (sha,) = repo.with_key("before/commit")
    assert got == f"Changes committed successfully with hash {sha}"
    assert repo.sent == ["before/add", "before/commit", "before/commit"]
    events = [(e.kind, e.op_id) for e in await ledger.backend.events("before")]
    lost = events.index(("lost", "before/commit"))
    read = events.index(("verified_not_committed", "before/commit"))
    sent_again = events.index(("gate_passed", "before/commit"), lost)
    assert lost < read < sent_again  # read back before the second attempt's gate
    commit = receipt.lines[1]
    assert commit.status is OpStatus.COMMITTED
    assert [e.ref for e in commit.evidence][:4] == ["gate", "transport", "horizon", "git_log"]
    assert commit.evidence[-1].kind is stopline.EvidenceKind.RESPONSE_DIGEST  # attempt 2
    assert [message for _, message in repo.commits()] == [
        "Notes\n\nStopline-Key: before/commit",
        "init",
    ]
    assert repo.git("show", f"{sha}:notes.txt") == "v3\n"
