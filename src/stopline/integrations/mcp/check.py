"""``stopline check-mcp``: the cancellation profile of any MCP server.

Read-only by default: discovery (the tools and what they declare:
``readOnlyHint``, ``idempotentHint``, stopline's ``_meta``, task support), a
probe for the tasks methods, whether ``stopline_verify`` is offered. Nothing
is called.

With a plan (``--plan FILE``, JSON or TOML) naming the tools it may call in a
sandbox instance, their arguments, where the idempotency key goes and a read
tool per effect, it runs the barrier matrix through stopline itself (a
scratch ledger, ``StoplineMCP``, an ``immediate`` cancel, so the SDK sends the
cancel the way the transport expects) and reports, per tool and cell, what
the server did and the receipt stopline gave::

    {"tools": {"pay": {
        "arguments": {"amount": 5},
        "key_argument": "idempotency_key",
        "read": {"tool": "find_payment", "arguments": {"idempotency_key": "{key}"},
                 "count": "count"},
        "hold": {"before":  {"tool": "ctl_hold",    "arguments": {"tool": "pay", "at": "50"}},
                 "reached": {"tool": "ctl_reached", "arguments": {"tool": "pay", "at": "50"}},
                 "release": {"tool": "ctl_release", "arguments": {"tool": "pay", "at": "50"}},
                 "ended":   {"tool": "ctl_ended",   "arguments": {"idempotency_key": "{key}"}}}}}}

``"{key}"`` anywhere in an argument is the call's idempotency key. ``read``
says where the effects show: ``count`` (a number) or ``found`` (a boolean) at
a dotted path of the read tool's structured result; a found effect settles an
unknown as committed, "not found" settles nothing (a read cannot prove that a
request still in flight will never commit). ``hold`` is optional: a sandbox's
own barrier, so that "during" is a moment inside the tool rather than "as soon
as the request was written".
"""

from __future__ import annotations

import contextlib
import copy
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, cast

import anyio
import mcp_types as types
from mcp_types import RequestParamsMeta

import stopline
from mcp import MCPError, StdioServerParameters
from stopline.domain.limits import check_wait
from stopline.domain.model import CancelState
from stopline.domain.vocab import (
    Cancellable,
    NoteKind,
    OpEvent,
    OpStatus,
    PhaseKind,
    Policy,
    RunEvent,
)
from stopline.errors import PlanError, RunFenced
from stopline.integrations.mcp._call import verdict_of
from stopline.integrations.mcp._task_state import TaskIdParams
from stopline.integrations.mcp._vocab import (
    CANCELLABLE_META,
    EFFECTS_META,
    KEY_META,
    VERIFY_TOOL,
    ToolPolicy,
)
from stopline.integrations.mcp.check_plan import Call, Plan, ToolPlan, load_plan, with_key
from stopline.integrations.mcp.check_report import (
    CELLS,
    CancelStops,
    Cell,
    Profile,
    ToolProfile,
)
from stopline.integrations.mcp.client import StoplineMCP
from stopline.integrations.mcp.tasks_client import Raw, TaskRequest
from stopline.runtime.context import CallContext
from stopline.runtime.ledger import VerifyBudget
from stopline.runtime.tool import NoAnswer, ReadBack, Verdict

__all__ = ["Plan", "PlanError", "ToolPlan", "check", "load_plan"]

_ANSWERS = (OpEvent.COMMITTED, OpEvent.REJECTED)  # the call's own answer
_READ_SETTLED = (OpEvent.VERIFIED_COMMITTED, OpEvent.VERIFIED_NOT_COMMITTED)


def declared(tool: types.Tool) -> dict[str, Any]:
    """What a tool listing says about the tool (hints are untrusted: reported, not relied on).

    A stopline ``_meta`` value outside the vocabulary is ignored by the client (the safe
    default applies), so it is not shown as declared: it is listed under ``ignored``.
    """
    notes = tool.annotations
    meta = tool.meta or {}
    effects, cancellable = meta.get(EFFECTS_META), meta.get(CANCELLABLE_META)
    ignored: dict[str, Any] = {}
    if effects is not None and not isinstance(effects, bool):
        ignored[EFFECTS_META], effects = effects, None
    if cancellable is not None and cancellable not in Cancellable.__members__.values():
        ignored[CANCELLABLE_META], cancellable = cancellable, None
    return {
        "name": tool.name,
        "readOnlyHint": notes.read_only_hint if notes else None,
        "idempotentHint": notes.idempotent_hint if notes else None,
        "destructiveHint": notes.destructive_hint if notes else None,
        "effects": effects,
        "cancellable": cancellable,
        "taskSupport": tool.execution.task_support if tool.execution else None,
        "ignored": ignored,
    }


class Checker:
    """One connection, one scratch ledger, the plan's tools through the matrix.

    Every wait is bounded by ``settle_timeout``: a control call, a read, an answer, the
    end of a run; a wait that runs out is reported on its cell, never waited out.
    """

    def __init__(
        self,
        ledger: stopline.Ledger,
        conn: StoplineMCP,
        plan: Plan,
        *,
        settle_timeout: float,
        on_step: Callable[[str], None],
    ) -> None:
        self.ledger, self.conn, self.plan = ledger, conn, plan
        self.settle_timeout = settle_timeout
        self.on_step = on_step
        self.written: dict[str, anyio.Event] = {}  # op id -> its tools/call is on the wire
        conn.on_request = self._written

    def _written(self, key: str, request_id: Any) -> None:
        self.written.setdefault(key, anyio.Event()).set()

    async def ctl(self, call: Call | None, key: str) -> Any:
        """A sandbox call (control or read); ``TimeoutError`` past the settle timeout."""
        if call is None:
            return None
        with anyio.fail_after(self.settle_timeout):
            result = await self.conn.client.call_tool(call.tool, with_key(call.arguments, key))
        return result.structured_content

    async def effects(self, tool: ToolPlan, key: str) -> int | None:
        """How many effects the server shows for ``key``; None: it could not tell (no read
        tool, a read that failed or did not answer in time, a verdict ``unknown``)."""
        try:
            return await self._effects(tool, key)
        except (TimeoutError, MCPError, NoAnswer):
            return None

    async def _effects(self, tool: ToolPlan, key: str) -> int | None:
        if tool.read is not None and tool.read_path is not None:
            out = await self.ctl(tool.read, key)
            path, is_count = tool.read_path
            for part in path.split("."):
                out = out.get(part) if isinstance(out, Mapping) else None
            if is_count:
                return int(out) if isinstance(out, int | float) else None
            return 1 if out is True else 0 if out is False else None
        if self.conn.offers_verify:
            with anyio.fail_after(self.settle_timeout):
                status = await self.conn.status(key, tool=tool.name)
            # the server's record: one key is one effect or none; "unknown" is unknown, and
            # so is "no record" of a tool the server does not track (ADR 0063)
            verdict = verdict_of(self.conn, tool.name, status)[0]
            return {Verdict.COMMITTED: 1, Verdict.NOT_COMMITTED: 0}.get(verdict)
        return None

    def verifier(self, tool: ToolPlan) -> Callable[[CallContext], Any]:
        async def read_back(ctx: CallContext) -> ReadBack:
            found = await self.effects(tool, ctx.key)
            ref = f"read:{tool.read.tool if tool.read else VERIFY_TOOL}:{ctx.key}"
            if found:
                return ReadBack(Verdict.COMMITTED, ref, f"{found} effect(s) found")
            return ReadBack(Verdict.UNKNOWN, ref, "not found (yet): a read alone proves nothing")

        return read_back

    def keyed(self, tool: ToolPlan) -> stopline.Tool[Any]:
        """The MCP tool, each call's ``"{key}"`` in its arguments replaced by its own key."""
        base = self.conn.tool(tool.name)
        keyed = copy.copy(base)

        async def invoke(ctx: CallContext, arguments: dict[str, Any] | None = None) -> Any:
            return await base.fn(ctx, with_key(arguments or {}, ctx.key))

        keyed.fn = invoke
        return keyed

    async def profile_tool(self, tool: ToolPlan) -> ToolProfile:
        listed = self.conn.listing[tool.name]
        profile = ToolProfile(tool.name, declared(listed))
        profile.read = (
            tool.read.tool if tool.read else (VERIFY_TOOL if self.conn.offers_verify else "")
        )
        cells: dict[str, Cell] = {}
        # after_result before after_acceptance: a whole call shows whether the server
        # gives any sign of acceptance (a cancelled "during" call may end before its first)
        for name in ("before_dispatch", "during", "after_result", "after_acceptance"):
            self.on_step(f"{tool.name}: {name.replace('_', ' ')}")
            if name == "after_acceptance" and not any(c.signals for c in cells.values()):
                cells[name] = Cell(
                    name, note="no sign of acceptance in a whole call (no progress, no task)"
                )
                continue
            cells[name] = await self.cell(tool, name, profile)
        profile.cells = [cells[name] for name in CELLS]
        self.on_step(f"{tool.name}: same key twice")
        profile.repeat_effects = await self.repeat(tool, profile)
        for cell in profile.cells:  # R13: a late commit shows later; read once more
            if cell.in_flight and cell.effects == 0 and not cell.proof:
                await anyio.sleep(max(0.0, cell.cancelled_at + self.settle_timeout - time.time()))
                await self._read(tool, cell)
        profile.findings = judge(profile)
        return profile

    async def repeat(self, tool: ToolPlan, profile: ToolProfile) -> int | None:
        key = f"check-repeat-{uuid.uuid4().hex[:12]}"
        args = dict(with_key(tool.arguments, key))
        if tool.key_argument:
            args[tool.key_argument] = key
        for attempt in (1, 2):
            with contextlib.suppress(MCPError), anyio.move_on_after(self.settle_timeout) as wait:
                await self.conn.client.call_tool(
                    tool.name, args, meta=cast(RequestParamsMeta, {KEY_META: key})
                )
            if wait.cancelled_caught:
                profile.repeat_answered = False
                profile.timeouts.append(
                    f"same key twice: call {attempt} got no answer within {self.settle_timeout:g} s"
                )
        return await self.effects(tool, key)

    async def cell(self, tool: ToolPlan, name: str, profile: ToolProfile) -> Cell:
        """One cell: the run works in its own task; the checker cancels it from outside, so
        the sandbox's control calls are never inside the scope the cancel interrupts."""
        cell = Cell(name)
        ledger = self.ledger
        ready, go, done = anyio.Event(), anyio.Event(), anyio.Event()
        ids: list[str] = []
        keyed = self.keyed(tool)

        async def workflow() -> None:
            try:
                async with ledger.run(f"check-mcp {tool.name} {name}", owner="check-mcp") as run:
                    ids.append(run.id)
                    ready.set()
                    await go.wait()
                    with contextlib.suppress(RunFenced, Exception):
                        async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
                            await run.call(keyed, dict(tool.arguments))
            finally:
                ready.set()
                done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow)
            await ready.wait()
            run_id = ids[0]
            try:
                await self._moment(tool, cell, run_id, go, done)
            except (TimeoutError, MCPError) as exc:
                cell.timeout = f"a sandbox control call failed or did not answer: {exc!r}"
            finally:
                if not go.is_set():  # the gate refuses it: nothing is sent
                    await self._cancel(cell, run_id, "the cell could not reach its moment")
                    go.set()
                with anyio.move_on_after(self.settle_timeout):
                    await done.wait()
                if not done.is_set():
                    cell.timeout = f"the run did not end within {self.settle_timeout:g} s"
                    tg.cancel_scope.cancel()
        await self._record(tool, cell, run_id, profile)
        return cell

    async def _cancel(self, cell: Cell, run_id: str, reason: str) -> None:
        cell.cancelled_at = time.time()
        await self.ledger.cancel(run_id, by="check-mcp", reason=reason)

    async def _moment(
        self, tool: ToolPlan, cell: Cell, run_id: str, go: anyio.Event, done: anyio.Event
    ) -> None:
        """Bring the call to the cell's moment and cancel it there."""
        wait = self.settle_timeout
        if cell.name == "before_dispatch":
            await self._cancel(cell, run_id, "cancel before dispatch")
            go.set()
            return
        if cell.name == "after_result":
            go.set()
            with anyio.move_on_after(wait):
                await done.wait()
            if not done.is_set():
                cell.timeout = f"no answer within {wait:g} s: cancelled then, in flight"
            await self._cancel(cell, run_id, "cancel after the result")
            return
        await self.ctl(tool.hold.get("before"), "")
        go.set()
        op_id = await self._reached(tool, cell.name, run_id, done)
        if op_id or not done.is_set():
            if not op_id:
                cell.note = f"no sign the server had the request within {wait:g} s: cancelled then"
            await self._cancel(cell, run_id, f"cancel {cell.name}")
        else:
            cell.note = "no sign the server had the request before its answer"
        await self.ctl(tool.hold.get("release"), "")
        if op_id and "ended" in tool.hold:
            try:
                await self.ctl(tool.hold["ended"], op_id)
                cell.ended = True
            except (TimeoutError, MCPError):
                cell.note = "the sandbox never reported that the request ended"

    async def _record(self, tool: ToolPlan, cell: Cell, run_id: str, profile: ToolProfile) -> None:
        """What the run shows: the receipt, what the call did, the server's effects."""
        receipt = await self._settled(run_id)
        cell.headline, cell.message = receipt.headline.value, receipt.message
        ops = await self.ledger.backend.operations(run_id)
        if not ops:
            cell.effects, cell.note = 0, "refused at the gate: nothing was sent"
            return
        op = ops[0]
        cell.key, cell.status = op.id, op.status.value
        events = await self.ledger.backend.events(run_id)
        cancel = next(
            (e.seq for e in events if e.op_id is None and e.kind == RunEvent.CANCEL), None
        )
        mine = [e for e in events if e.op_id == op.id]
        answer = next((e.seq for e in mine if e.kind in _ANSWERS), None)
        cell.answered_first = answer is not None and (cancel is None or answer < cancel)
        cell.not_sent = any(e.kind == OpEvent.NOT_SENT for e in mine)
        if cell.answered_first and cell.name != "after_result":
            cell.note = "the call answered before the cancel: no cancel verdict"
        elif cell.not_sent:
            cell.note = "the cancel came before the request was written: nothing was sent"
        cell.lost = any(e.kind == OpEvent.LOST for e in mine)
        cell.settled_by_read = any(e.kind in _READ_SETTLED for e in mine)
        profile.progress += sum(1 for e in mine if e.kind == NoteKind.PROGRESS)
        cell.signals = sum(
            1 for e in mine if e.kind == NoteKind.PROGRESS or e.to_state == OpStatus.ACCEPTED
        )
        if op.status is OpStatus.NOT_COMMITTED and not cell.not_sent:
            cell.proof = "stopline's ledger: not_committed"
        elif op.cancel_state is CancelState.CONFIRMED:
            cell.proof = "the server confirmed the cancel"
        cell.horizon = op.horizon
        await self._read(tool, cell)

    async def _read(self, tool: ToolPlan, cell: Cell) -> None:
        """Read the cell's effects (again), and what a "none" then proves (R13)."""
        cell.effects = await self.effects(tool, cell.key)
        cell.late_answer = any(late.key == cell.key for late in self.conn.late)
        if cell.cancelled_at:
            cell.seen_after = max(0.0, time.time() - cell.cancelled_at)
        if cell.effects == 0 and not cell.proof:
            if cell.ended:
                cell.proof = "the sandbox reported the request ended; its read found no effect"
            elif cell.horizon is not None and time.time() >= cell.horizon:
                cell.proof = "a read after the operation's horizon found no effect"

    async def _reached(self, tool: ToolPlan, name: str, run_id: str, done: anyio.Event) -> str:
        """Wait for the cell's moment: the operation id, or "" if it never came."""
        with anyio.move_on_after(self.settle_timeout):
            while not (ops := await self.ledger.backend.operations(run_id)):
                await self.ledger.wait_for_change(run_id)
            op_id = ops[0].id
            if name == "during":
                if "reached" in tool.hold:
                    await self.ctl(tool.hold["reached"], op_id)
                else:
                    await self.written.setdefault(op_id, anyio.Event()).wait()
                return op_id
            while not done.is_set():  # after acceptance: the server's own signal
                op = await self.ledger.backend.get_operation(op_id)
                events = await self.ledger.backend.events(run_id)
                if op.status is OpStatus.ACCEPTED or any(
                    e.kind == NoteKind.PROGRESS for e in events
                ):
                    return op_id
                await self.ledger.wait_for_change(run_id)
        return ""

    async def _settled(self, run_id: str) -> stopline.Receipt:
        try:
            return await self.ledger.wait_settled(run_id, timeout=self.settle_timeout)
        except TimeoutError:
            return await self.ledger.receipt(run_id)


def judge(profile: ToolProfile) -> list[str]:
    """What a server author should fix, from the evidence in the cells."""
    out = []
    for cell in profile.cells:
        if cell.status in ("unknown", "needs_review"):
            out.append(f"{cell.name}: stopline cannot prove the outcome ({cell.message})")
        if cell.timeout:
            out.append(f"{cell.name}: {cell.timeout}")
    out += profile.timeouts
    if profile.repeat_effects is not None and profile.repeat_effects > 1:
        out.append("one idempotency key twice made two effects: a re-issued request doubles")
    if not profile.read:
        out.append(
            "no read tool: effects cannot be counted (add one to the plan, or stopline_verify)"
        )
    elif profile.repeat_effects is None:
        out.append(f"same key twice: {profile.read} could not tell how many effects")
    if profile.declared.get("cancellable") == Cancellable.AFTER_ACCEPTED and (
        profile.cancel_stops is CancelStops.NO
    ):
        out.append("declares it can cancel after acceptance, but a cancel did not stop it")
    return out


async def tasks_support(conn: StoplineMCP, wait: float) -> str:
    """Probe the tasks methods with an id nobody holds. Only an answer proves them: a
    result, or -32602 (the method exists and refused the id); -32601 means no; any other
    error, or none within ``wait``, proves neither."""
    client = conn.client
    legacy = client.server_capabilities.tasks
    if legacy is not None:
        return "2025-11-25 (capabilities.tasks)"

    probe = TaskRequest(method="tasks/get", params=TaskIdParams(task_id=f"probe-{uuid.uuid4()}"))
    try:
        with anyio.fail_after(wait):
            await client.session.send_request(probe, Raw)
    except TimeoutError:
        return f"unknown (tasks/get got no answer within {wait:g} s)"
    except MCPError as exc:
        if exc.error.code == types.METHOD_NOT_FOUND:
            return "no"
        if exc.error.code != types.INVALID_PARAMS:
            return f"unknown (tasks/get answered error {exc.error.code})"
    return "2026-07-28 (io.modelcontextprotocol/tasks)"


@contextlib.asynccontextmanager
async def _scratch(workdir: Path) -> AsyncIterator[stopline.Ledger]:
    budget = VerifyBudget(attempts=3, first_delay=0.05)
    async with stopline.open(f"sqlite:///{workdir / 'check-mcp.db'}", verify=budget) as ledger:
        yield ledger


async def check(
    target: StdioServerParameters | str,
    *,
    mode: str = "auto",
    plan: Plan | None = None,
    workdir: Path,
    settle_timeout: float = 15.0,
    connect_timeout: float = 30.0,
    on_step: Callable[[str], None] = lambda step: None,
) -> Profile:
    """Profile ``target``; read-only unless ``plan`` names tools to call. Opening (a
    stdio server's start, the handshake) is bounded by ``connect_timeout``, each wait
    after it by ``settle_timeout``: a server that takes longer to start than a cell to
    settle (``npx``'s first run) is still checked."""
    check_wait("settle_timeout", settle_timeout)  # before anything is called
    check_wait("connect_timeout", connect_timeout)
    label = target if isinstance(target, str) else " ".join([target.command, *target.args])
    profile = Profile(label)
    plan = plan or Plan({})
    policies = {
        name: ToolPolicy(effects=True, key_argument=tool.key_argument, task=True)
        for name, tool in plan.tools.items()
    }
    opened = StoplineMCP(  # a server that never answers: no connection, within the bound
        target,
        mode=mode,
        name="check",
        policies=policies,
        tasks=True,
        connect_timeout=connect_timeout,
    )
    async with opened as conn:
        on_step("discovery")
        client = conn.client
        profile.protocol_version = client.protocol_version
        info = client.server_info
        profile.server = f"{info.name} {info.version}".strip() if info else ""
        profile.tools = [declared(t) for t in conn.listing.values()]
        profile.verify_tool = conn.offers_verify
        profile.tasks = await tasks_support(conn, settle_timeout)
        missing = sorted(set(plan.tools) - set(conn.listing))
        if missing:
            raise PlanError(f"the plan names tools the server does not list: {', '.join(missing)}")
        async with _scratch(workdir) as ledger:
            checker = Checker(ledger, conn, plan, settle_timeout=settle_timeout, on_step=on_step)
            for tool in plan.tools.values():
                if tool.read is not None:
                    conn.verifiers[tool.name] = checker.verifier(tool)
                profile.checked.append(await checker.profile_tool(tool))
    return profile
