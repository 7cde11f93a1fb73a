"""A LangGraph thread's runs: the next one after a run that ended, and what the
earlier ones recorded (ADR 0107).

A thread outlives a stopline run. Its run ends ``completed`` or ``failed`` when
the ``sl.run`` block does, and the thread goes on: a new user message, or
LangGraph's retry after an error (``graph.ainvoke(None, config)``, which runs
the failed superstep again from the last checkpoint: a ``ToolNode`` whose one
call raised runs *all* its calls again, the ones that committed too). Such a
run cannot be entered again (final states, R10), and a run of a new id sent
everything again: its keys named nothing recorded.

**The thread's runs** (``runs_of``): ``BASE`` (the thread id, or the ``run_id``
given), then ``BASE@turn:2``, ``BASE@turn:3`` ... (``turn_id``), each made only
when the one before it ended ``completed`` or ``failed``, so the first of them
that did not is the one ``sl.run`` enters (created if it does not exist yet);
one that was cancelled, is in review or is paused is entered as before (resumed
first, R10). An id of the form ``X@turn:N`` names thread ``X``'s runs (a
recovery step that says "re-enter with the same run id" reaches the same run).
Found again by ids alone, read in batches (``get_runs``): nothing is written
but the runs themselves.

**What an earlier run recorded** (``answer``): a call whose key (``tool:<id>``,
a node's task) an earlier run of the thread recorded is answered from that
record, the gate's own rule across runs (``on_resume``): one that happened is
replayed and not sent; one in doubt is read back first (R5) and then replayed,
sent, or refused (``OperationInDoubt``: nothing sent); one that provably did not
happen goes through this run's gate and is sent. The same key with other
arguments is a reused id, refused before anything is sent (ADR 0054).

**A repeat of a call left in doubt** (``_repeated``, ADR 0112, ADR 0120): a call under a
new id with the same tool and arguments (the digest the gate records) as a call an
earlier run left without its answer for the model (its log shows the answer lost, or
coming after its run ended: the model was told it failed or was in doubt; the user
asks again) is that call, answered as above: ADR 0097's open calls, across the
thread's runs, whatever it has settled to since. Settled ``committed`` or corrected,
it is replayed from its record, not sent; provably not done, the repeat is sent. Once
the model has had an answer from its record (a repeat or a retry replayed from it),
the call carries a note saying so (``repeat_answered``) and matches no further
repeat: a later identical call is a new request. The model's answer for a call in
doubt says what its record proves and what settles it, in its receipt's words
(``_open_calls.in_doubt_note``): a call still running there is settled by its own
answer, not by a read-back.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections.abc import Sequence
from typing import Any

from stopline.domain import jsontext
from stopline.domain.guidance import OnResume, on_resume
from stopline.domain.lifecycle import tenant_of
from stopline.domain.limits import MAX_ID_CHARS, check_id, fitted
from stopline.domain.model import EventRecord, OperationRecord, args_digest
from stopline.domain.vocab import NoteKind, OpStatus, RunState
from stopline.errors import (
    InvalidInput,
    OperationInDoubt,
    UnknownOperation,
    UnknownRun,
    UnstableValue,
)
from stopline.integrations._frameworks import Bound, current
from stopline.integrations._replayed import not_kept
from stopline.runtime.ledger import Ledger
from stopline.runtime.tool import Tool

__all__ = [
    "KEPT",
    "OVER",
    "Thread",
    "answer",
    "for_model",
    "remember",
    "runs_of",
    "turn_id",
]

_TURN = re.compile(r"@turn:([1-9][0-9]*)\Z")
OVER = frozenset({RunState.COMPLETED, RunState.FAILED})  # ended on its own: a next run
# the mark of a result kept as LangGraph's serializer writes it (``_langgraph_calls``)
KEPT = "io.stopline/langgraph"
_KEY_ROOM = 256  # a derived id leaves this much of the ledger's id length for keys
_BATCH = 16  # runs read at once while looking for the thread's current one, first
_MOST = 1024  # ... and at most


def turn_id(base: str, n: int) -> str:
    """The id of the thread's ``n``-th run: ``BASE``, then ``BASE@turn:N`` (too long:
    its printable start and a digest, ``fitted``)."""
    return base if n == 1 else fitted(f"{base}@turn:{n}", MAX_ID_CHARS - _KEY_ROOM)


@dataclasses.dataclass(frozen=True, slots=True)
class Thread:
    """Where a thread's runs stand: the one to enter, and the earlier ones whose
    records answer its calls (most recent first; of the tenant entering only)."""

    run_id: str
    earlier: tuple[str, ...] = ()
    new: bool = False  # ``run_id`` did not exist when read: this entry makes it (``claim``)


async def runs_of(ledger: Ledger, base: str, tenant: str) -> Thread:
    """The run ``sl.run`` enters for the thread whose first run is ``base``: the first
    that did not end ``completed`` or ``failed`` (created when it does not exist)."""
    check_id("run_id", base)  # as ``ledger.run`` would say it
    found = _TURN.search(base)
    if found is not None:  # a later run's id: its thread's
        base = base[: found.start()]
    earlier: list[str] = []
    n, batch = 1, _BATCH
    while True:  # a long thread: reads double in size, so its runs take log reads
        ids = [turn_id(base, n + i) for i in range(batch)]
        records = await ledger.backend.get_runs(ids)
        for run_id in ids:
            record = records.get(run_id)
            if record is None or record.state not in OVER:
                return Thread(run_id, tuple(reversed(earlier)), new=record is None)
            if tenant_of(record) == tenant:  # another tenant's records are not read
                earlier.append(run_id)
        n, batch = n + batch, min(batch * 2, _MOST)


# the earlier runs of the thread of each entry (a ``Bound``), set by ``sl.run``
_EARLIER: weakref.WeakKeyDictionary[Bound, tuple[str, ...]] = weakref.WeakKeyDictionary()


def remember(bound: Bound, thread: Thread) -> None:
    """The calls of ``bound``'s entry are answered from ``thread``'s earlier runs."""
    _EARLIER[bound] = thread.earlier


async def answer(
    tool: Tool[Any], key: str | None, args: Sequence[Any], kwargs: dict[str, Any]
) -> OperationRecord | None:
    """The record of an earlier run of the thread that answers this call of ``tool``
    under ``key`` (``args``, ``kwargs``: as the gate digests them): one that happened,
    read back first if it was in doubt. ``None``: the call goes through this run's
    gate (no earlier run recorded it, or it provably did not happen there). In doubt
    after the read-back: ``OperationInDoubt``, nothing sent; the same key with other
    arguments: ``InvalidInput``, nothing sent."""
    bound = current()
    earlier = _EARLIER.get(bound, ())
    if key is None or not earlier or not tool.effects:  # a read records nothing
        return None
    read = await bound.ledger.backend.get_operations([f"{run}/{key}" for run in earlier])
    found = [op for op in read if not isinstance(op, UnknownOperation)]
    digest = _digest(args, kwargs)
    if not found:  # a new id: a repeat of a call an earlier run left in doubt, if any
        found = await _repeated(bound, tool.name, key, digest, earlier)
    for op in found:
        if op.args_digest != digest:
            raise InvalidInput(
                "tool call id",
                f"{key!r} (a {tool.name} call) reuses the id of {op.id!r}, a call of an "
                "earlier run of this thread with other arguments: nothing was sent, and "
                "stopline does not guess which call it is (ADR 0054, ADR 0107)",
            )
    for op in found:  # worst first: what happened in any of them is not sent again
        if on_resume(op.status) is OnResume.REPLAYED:
            return await _answered(bound, op, key)
    for op in found:
        if on_resume(op.status) is OnResume.BLOCKS:  # in doubt: read back first (R5)
            bound.ledger.register_tool(tool)  # the read-back is this tool's verifier
            op = await bound.ledger.verify(op.id)
            if on_resume(op.status) is OnResume.REPLAYED:
                return await _answered(bound, op, key)
            if on_resume(op.status) is OnResume.BLOCKS:
                raise OperationInDoubt(op.id, op.status)
    return None  # it did not happen in any: sent in this run


# the calls of the earlier runs of each entry's thread, by (tool, digest), read once per
# entry, and the logs of their runs read for a repeat (``_Calls``)
@dataclasses.dataclass(slots=True)
class _Calls:
    by_call: dict[tuple[str, str], list[str]] | None = None  # read at the first repeat
    logs: dict[str, list[EventRecord]] = dataclasses.field(default_factory=dict)


def _calls(bound: Bound) -> _Calls:
    found = _CALLS.get(bound)
    if found is None:
        found = _CALLS[bound] = _Calls()
    return found


_CALLS: weakref.WeakKeyDictionary[Bound, _Calls] = weakref.WeakKeyDictionary()
_LOST = frozenset({OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW})  # its answer did not come
_SENT = frozenset({OpStatus.REQUESTED, OpStatus.ACCEPTED})


async def _repeated(
    bound: Bound, tool: str, key: str, digest: str, earlier: tuple[str, ...]
) -> list[OperationRecord]:
    """The calls of the earlier runs that a call under a new ``key`` repeats (the same
    tool, the same digest): each still in doubt, or settled since but left without its
    answer for the model and answered to it from its record by no call since (``_left``):
    ADR 0097's open calls across the thread's runs (ADR 0112, ADR 0120). None when this
    run recorded ``key`` (its own gate answers it)."""
    calls = _calls(bound)
    if calls.by_call is None:
        calls.by_call = {}
        for tree in await bound.ledger.backend.runs_and_operations(earlier):
            for op in () if isinstance(tree, UnknownRun) else tree[1]:
                if op.compensates is None:  # a correction is no call of the model's
                    calls.by_call.setdefault((op.tool, op.args_digest), []).append(op.id)
    same = calls.by_call.get((tool, digest))
    if not same:
        return []
    try:
        await bound.ledger.backend.get_operation(f"{bound.run.id}/{key}")
        return []
    except UnknownOperation:
        pass
    read = await bound.ledger.backend.get_operations(same)
    ops = [op for op in read if not isinstance(op, UnknownOperation)]
    blocks = [op for op in ops if on_resume(op.status) is OnResume.BLOCKS]
    happened = [op for op in ops if on_resume(op.status) is OnResume.REPLAYED]
    return blocks + [op for op in happened if await _left(bound, calls, op)]


async def _left(bound: Bound, calls: _Calls, op: OperationRecord) -> bool:
    """Whether the model was left without ``op``'s answer and has had none from its
    record since: its log shows the answer lost (``unknown``, in review) or coming after
    its run had ended (the run's graph raised while it was at work), and no
    ``repeat_answered`` note."""
    log = calls.logs.get(op.run_id)
    if log is None:
        log = calls.logs[op.run_id] = await bound.ledger.backend.events(op.run_id)
    mine = [e for e in log if e.op_id == op.id]
    if any(e.kind == NoteKind.REPEAT_ANSWERED for e in mine):
        return False
    if any(e.to_state in _LOST for e in mine):
        return True
    end = next((e.seq for e in log if e.op_id is None and e.to_state in OVER), None)
    return end is not None and any(e.seq > end and e.from_state in _SENT for e in mine)


async def _answered(bound: Bound, op: OperationRecord, key: str) -> OperationRecord:
    """``op``, an earlier run's call that happened, answers this run's call ``key`` from
    its record: when the model was left without its answer (``_left``), a note on it says
    so, and it matches no further repeat (a later identical call is a new request)."""
    calls = _calls(bound)
    if await _left(bound, calls, op):
        by = f"{bound.run.id}/{key}"
        await bound.ledger.backend.note(op.id, NoteKind.REPEAT_ANSWERED, {"by": by})
        calls.logs.pop(op.run_id, None)  # read again with the note, if needed again
    return op


def _digest(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """The digest the gate records of a call's arguments (``Run.call_with``)."""
    try:
        return args_digest([list(args), kwargs])
    except UnstableValue as exc:
        return f"unstable:{exc.path}"


def for_model(op: OperationRecord, key: str | None = None) -> Any:
    """An earlier run's call, replayed, as the tool's answer to the call ``key``: its
    recorded result; or a note saying it happened and its result was not kept, or that
    the call under ``key`` repeats it and was not sent (never ``None``: the model is told
    what the record proves, and no more)."""
    why = not_kept(op)
    repeat = key is not None and not op.id.endswith(f"/{key}")
    if why is None and not repeat:
        return op.result
    said = [f"the ledger records it {op.status.value}"]
    if why is not None:
        said.append(f"its result was not kept ({why})")
    elif isinstance(op.result, str):
        said.append(f"its answer then: {op.result}")
    elif not (isinstance(op.result, dict) and KEPT in op.result):  # not a kept Command
        said.append(f"its answer then: {jsontext.compact_or_str(op.result)}")
    if repeat:
        head = (
            f"{op.tool} was called in an earlier run of this thread with the same arguments "
            f"({op.id}) and was not sent again, so that it cannot happen twice"
        )
    else:
        head = f"{op.tool} was done in an earlier run of this thread ({op.id})"
    return f"{head}: {'; '.join(said)}. Do not call it again for the same request."
