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
import dataclasses
import json
import tomllib
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
from stopline.domain.vocab import Cancellable, NoteKind, OpStatus, PhaseKind, Policy
from stopline.errors import PlanError, RunFenced
from stopline.integrations.mcp._task_state import TaskIdParams
from stopline.integrations.mcp._vocab import (
    CANCELLABLE_META,
    EFFECTS_META,
    KEY_META,
    VERIFY_TOOL,
    ToolPolicy,
)
from stopline.integrations.mcp.check_report import CELLS, Cell, Profile, ToolProfile
from stopline.integrations.mcp.client import StoplineMCP
from stopline.integrations.mcp.tasks_client import Raw, TaskRequest
from stopline.runtime.context import CallContext
from stopline.runtime.ledger import VerifyBudget
from stopline.runtime.tool import ReadBack, Verdict

__all__ = ["Plan", "PlanError", "ToolPlan", "check", "load_plan"]


@dataclasses.dataclass(frozen=True)
class Call:
    tool: str
    arguments: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    name: str
    arguments: Mapping[str, Any]
    key_argument: str | None = None
    read: Call | None = None
    read_path: tuple[str, bool] | None = None  # (dotted path, is a count)
    hold: Mapping[str, Call] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Plan:
    tools: Mapping[str, ToolPlan]


def _call(raw: Any, where: str) -> Call:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("tool"), str):
        raise PlanError(f"{where}: expected {{'tool': NAME, 'arguments': {{...}}}}")
    args = raw.get("arguments", {})
    if not isinstance(args, Mapping):
        raise PlanError(f"{where}.arguments: expected a table of arguments")
    return Call(raw["tool"], dict(args))


def load_plan(path: Path) -> Plan:
    """Read a plan (``.toml`` or JSON); ``PlanError`` names the first problem."""
    try:
        text = path.read_text()
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read the plan {path}: {exc}") from exc
    tools = raw.get("tools") if isinstance(raw, Mapping) else None
    if not isinstance(tools, Mapping) or not tools:
        raise PlanError(f"{path}: expected a 'tools' table naming at least one tool")
    out: dict[str, ToolPlan] = {}
    for name, spec in tools.items():
        where = f"tools.{name}"
        if not isinstance(spec, Mapping):
            raise PlanError(f"{where}: expected a table")
        args = spec.get("arguments", {})
        key_argument = spec.get("key_argument")
        if not isinstance(args, Mapping) or not isinstance(key_argument, str | None):
            raise PlanError(f"{where}: 'arguments' must be a table, 'key_argument' a string")
        read, read_path = None, None
        if "read" in spec:
            read = _call(spec["read"], f"{where}.read")
            count, found = spec["read"].get("count"), spec["read"].get("found")
            if not isinstance(count or found, str):
                raise PlanError(f"{where}.read: name the result's 'count' or 'found' field")
            read_path = (str(count or found), count is not None)
        hold = {k: _call(v, f"{where}.hold.{k}") for k, v in (spec.get("hold") or {}).items()}
        if hold and not {"before", "release"} <= set(hold):
            raise PlanError(f"{where}.hold: needs at least 'before' and 'release'")
        out[name] = ToolPlan(name, dict(args), key_argument, read, read_path, hold)
    return Plan(out)


def _with_key(value: Any, key: str) -> Any:
    if isinstance(value, str):
        return value.replace("{key}", key)
    if isinstance(value, Mapping):
        return {k: _with_key(v, key) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_key(v, key) for v in value]
    return value


def declared(tool: types.Tool) -> dict[str, Any]:
    """What a tool listing says about the tool (hints are untrusted: reported, not relied on)."""
    notes = tool.annotations
    meta = tool.meta or {}
    return {
        "name": tool.name,
        "readOnlyHint": notes.read_only_hint if notes else None,
        "idempotentHint": notes.idempotent_hint if notes else None,
        "destructiveHint": notes.destructive_hint if notes else None,
        "effects": meta.get(EFFECTS_META),
        "cancellable": meta.get(CANCELLABLE_META),
        "taskSupport": tool.execution.task_support if tool.execution else None,
    }


class Checker:
    """One connection, one scratch ledger, the plan's tools through the matrix."""

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
        if call is None:
            return None
        result = await self.conn.client.call_tool(call.tool, _with_key(call.arguments, key))
        return result.structured_content

    async def effects(self, tool: ToolPlan, key: str) -> int | None:
        """How many effects the server's read tool shows for ``key`` (None: no way to tell)."""
        if tool.read is not None and tool.read_path is not None:
            out = await self.ctl(tool.read, key)
            path, is_count = tool.read_path
            for part in path.split("."):
                out = out.get(part) if isinstance(out, Mapping) else None
            if is_count:
                return int(out) if isinstance(out, int | float) else None
            return 1 if out is True else 0 if out is False else None
        if self.conn.offers_verify:
            status = await self.conn.status(key)
            return 1 if status.get("verdict") == "committed" else 0
        return None

    def verifier(self, tool: ToolPlan) -> Callable[[CallContext], Any]:
        async def read_back(ctx: CallContext) -> ReadBack:
            found = await self.effects(tool, ctx.key)
            ref = f"read:{tool.read.tool if tool.read else VERIFY_TOOL}:{ctx.key}"
            if found:
                return ReadBack(Verdict.COMMITTED, ref, f"{found} effect(s) found")
            return ReadBack(Verdict.UNKNOWN, ref, "not found (yet): a read alone proves nothing")

        return read_back

    async def profile_tool(self, tool: ToolPlan) -> ToolProfile:
        listed = self.conn.listing[tool.name]
        profile = ToolProfile(tool.name, declared(listed))
        profile.read = (
            tool.read.tool if tool.read else (VERIFY_TOOL if self.conn.offers_verify else "")
        )
        cells: dict[str, Cell] = {}
        for name in ("before_dispatch", "during", "after_acceptance", "after_result"):
            self.on_step(f"{tool.name}: {name.replace('_', ' ')}")
            if name == "after_acceptance" and not cells["during"].signals:
                cells[name] = Cell(name, note="no sign of acceptance (no progress, no task)")
                continue
            cells[name] = await self.cell(tool, name, profile)
        profile.cells = [cells[name] for name in CELLS]
        self.on_step(f"{tool.name}: same key twice")
        profile.repeat_effects = await self.repeat(tool)
        profile.findings = judge(profile)
        return profile

    async def repeat(self, tool: ToolPlan) -> int | None:
        key = f"check-repeat-{uuid.uuid4().hex[:12]}"
        args = dict(_with_key(tool.arguments, key))
        if tool.key_argument:
            args[tool.key_argument] = key
        for _ in range(2):
            with contextlib.suppress(MCPError):
                await self.conn.client.call_tool(
                    tool.name, args, meta=cast(RequestParamsMeta, {KEY_META: key})
                )
        return await self.effects(tool, key)

    async def cell(self, tool: ToolPlan, name: str, profile: ToolProfile) -> Cell:
        """One cell: the run works in its own task; the checker cancels it from outside, so
        the sandbox's control calls are never inside the scope the cancel interrupts."""
        cell = Cell(name)
        ledger = self.ledger
        ready, go, done = anyio.Event(), anyio.Event(), anyio.Event()
        ids: list[str] = []

        async def workflow() -> None:
            try:
                async with ledger.run(f"check-mcp {tool.name} {name}", owner="check-mcp") as run:
                    ids.append(run.id)
                    ready.set()
                    await go.wait()
                    with contextlib.suppress(RunFenced, Exception):
                        async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
                            await self.conn.call(run, tool.name, dict(tool.arguments))
            finally:
                ready.set()
                done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow)
            await ready.wait()
            run_id = ids[0]
            if name == "before_dispatch":
                await ledger.cancel(run_id, by="check-mcp", reason="cancel before dispatch")
                go.set()
            elif name == "after_result":
                go.set()
                await done.wait()
                await ledger.cancel(run_id, by="check-mcp", reason="cancel after the result")
            else:
                await self.ctl(tool.hold.get("before"), "")
                go.set()
                op_id = await self._reached(tool, name, run_id, done)
                if op_id:
                    await ledger.cancel(run_id, by="check-mcp", reason=f"cancel {name}")
                else:
                    cell.note = "no sign the server had the request (no progress, no task)"
                await self.ctl(tool.hold.get("release"), "")
                with anyio.move_on_after(self.settle_timeout) as waited:
                    if op_id:
                        with contextlib.suppress(MCPError):
                            await self.ctl(tool.hold.get("ended"), op_id)
                if waited.cancelled_caught:
                    cell.note = "the sandbox never reported that the request ended"
        receipt = await self._settled(run_id)
        cell.headline, cell.message = receipt.headline.value, receipt.message
        ops = await ledger.backend.operations(run_id)
        if not ops:
            cell.effects, cell.note = 0, "refused at the gate: nothing was sent"
            return cell
        op = ops[0]
        cell.status = op.status.value
        cell.late_answer = any(late.key == op.id for late in self.conn.late)
        cell.effects = await self.effects(tool, op.id)
        events = await ledger.backend.events(run_id)
        mine = [e for e in events if e.op_id == op.id]
        profile.progress += sum(1 for e in mine if e.kind == NoteKind.PROGRESS)
        cell.signals = sum(
            1 for e in mine if e.kind == NoteKind.PROGRESS or e.to_state == OpStatus.ACCEPTED
        )
        return cell

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
    if profile.repeat_effects is not None and profile.repeat_effects > 1:
        out.append("one idempotency key twice made two effects: a re-issued request doubles")
    if profile.repeat_effects is None:
        out.append(
            "no read tool: effects cannot be counted (add one to the plan, or stopline_verify)"
        )
    if profile.declared.get("cancellable") == Cancellable.AFTER_ACCEPTED and (
        profile.cancel_stops == "no"
    ):
        out.append("declares it can cancel after acceptance, but a cancel did not stop it")
    return out


async def tasks_support(conn: StoplineMCP) -> str:
    """Probe the tasks methods with an id nobody holds: -32602 means they exist."""
    client = conn.client
    legacy = client.server_capabilities.tasks
    if legacy is not None:
        return "2025-11-25 (capabilities.tasks)"

    probe = TaskRequest(method="tasks/get", params=TaskIdParams(task_id=f"probe-{uuid.uuid4()}"))
    try:
        await client.session.send_request(probe, Raw)
    except MCPError as exc:
        if exc.error.code == types.METHOD_NOT_FOUND:
            return "no"
        return "2026-07-28 (io.modelcontextprotocol/tasks)"
    return "2026-07-28 (io.modelcontextprotocol/tasks)"


@contextlib.asynccontextmanager
async def _scratch(workdir: Path) -> AsyncIterator[stopline.Ledger]:
    budget = VerifyBudget(attempts=3, first_delay=0.05)
    async with stopline.open(f"sqlite:///{workdir / 'check-mcp.db'}", verify=budget) as ledger:
        yield ledger


async def check(
    target: StdioServerParameters | str,
    *,
    mode: str = "2026-07-28",
    plan: Plan | None = None,
    workdir: Path,
    settle_timeout: float = 15.0,
    on_step: Callable[[str], None] = lambda step: None,
) -> Profile:
    """Profile ``target``; read-only unless ``plan`` names tools to call."""
    check_wait("settle_timeout", settle_timeout)  # before anything is called
    label = target if isinstance(target, str) else " ".join([target.command, *target.args])
    profile = Profile(label)
    plan = plan or Plan({})
    policies = {
        name: ToolPolicy(effects=True, key_argument=tool.key_argument, task=True)
        for name, tool in plan.tools.items()
    }
    async with StoplineMCP(target, mode=mode, name="check", policies=policies, tasks=True) as conn:
        on_step("discovery")
        client = conn.client
        profile.protocol_version = client.protocol_version
        info = client.server_info
        profile.server = f"{info.name} {info.version}".strip() if info else ""
        profile.tools = [declared(t) for t in conn.listing.values()]
        profile.verify_tool = conn.offers_verify
        profile.tasks = await tasks_support(conn)
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
