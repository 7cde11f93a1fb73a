"""What a PostgreSQL write whose reply was lost did: each answers from the ledger
whether the write landed (its result) or not (``RETRY``: run it again).

``PostgresBackend.attempts`` calls one after a doubt, on a new connection, once the
session the write went out on is gone (``Sessions``): until then, not found is not
yet, not "did not land" (ADR 0061)."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from stopline.domain.model import Evidence, OperationSpec
from stopline.domain.transitions import OPERATION_TABLE, RUN_TABLE, apply
from stopline.domain.vocab import Cause, OpEvent, OpStatus, RunEvent
from stopline.errors import IllegalTransition
from stopline.ledger.backend import GateResult, GateVerdict, OutcomeUpdate, RunSpec
from stopline.ledger.engine.gate import gate_committed
from stopline.ledger.engine.reads import attempt_logged, found_run, load_op, load_run, run_query
from stopline.ledger.engine.record import record
from stopline.ledger.postgres_txn import Tx

__all__ = [
    "RETRY",
    "Sessions",
    "attempt_token",
    "gate_landed",
    "logged",
    "nothing",
    "outcome_landed",
    "run_landed",
    "run_moved",
    "settle_gates",
]

RETRY = object()  # a settle function's answer: the write did not land, run it again

# A session that is still there, started before its write was lost (so not another
# session the server gave its process id since): asked to end. PostgreSQL ends a
# session's transaction with its process, and a process whose client is gone ends only
# once it reads from the socket (a frozen one, one whose statement is still on the way
# through a network or a proxy, may commit it first). A second round's read finds it
# gone. The server's own clock on both sides; a second's margin for the session's
# start against the moment the write was lost (what this process measured).
_SESSION_THERE = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = ?"
    " AND backend_start < now() - make_interval(secs => ?) + interval '1 second'"
)


class Sessions:
    """The server sessions a write went out on whose reply was lost: a read that settles
    the write is final once each is gone (its statement can land no more)."""

    def __init__(self) -> None:
        self._lost: dict[int, float] = {}  # server pid -> when its reply was lost

    def __bool__(self) -> bool:
        return bool(self._lost)

    def lost(self, tx: Tx) -> None:
        if tx.pid:  # 0: no session known (a connection that never started one)
            self._lost[tx.pid] = time.monotonic()

    async def gone(self, tx: Tx) -> bool:
        """Every lost session ended (those still there are asked to end)."""
        for pid, since in list(self._lost.items()):
            if await tx.one(_SESSION_THERE, (pid, time.monotonic() - since)) is None:
                self._lost.pop(pid, None)
        return not self._lost


def attempt_token() -> str:
    """A write attempt's mark, read back after its reply is lost (a UUID's 32 hex digits,
    without building a ``uuid.UUID`` on every gate)."""
    return os.urandom(16).hex()


async def nothing(tx: Tx) -> None:
    """The answer of a write that returns nothing, once found landed."""


def gate_landed(spec: OperationSpec, token: str) -> Callable[[Tx], Awaitable[Any]]:
    """After a lost reply: the gate attempt ``token`` landed (``PASSED``) or not (retry)."""

    async def settle(tx: Tx) -> Any:
        fence = await gate_committed(tx, spec.id, token)
        return RETRY if fence is None else GateResult(GateVerdict.PASSED, fence=fence)

    return settle


def run_landed(spec: RunSpec) -> Callable[[Tx], Awaitable[Any]]:
    """After a lost reply: the run was created (a run of this id, name, owner, tenant and
    parent is there) or not (retry); a different run of this id is left to the retry,
    which the ledger refuses as it refuses any id taken."""

    async def settle(tx: Tx) -> Any:
        found = await tx.all(*run_query(spec.id))
        if not found:
            return RETRY
        run = found_run(found, spec.id)
        mine = (run.name, run.owner, run.tenant, run.parent_id)
        return run if mine == (spec.name, spec.owner, spec.tenant, spec.parent_id) else RETRY

    return settle


def _moved_on(table: Mapping[tuple[Any, Any], Any], state: Any, event: Any) -> bool:
    """The state no longer takes ``event``: the write that moved it by it landed."""
    try:
        apply(table, state, event)
    except IllegalTransition:
        return True
    return False


def run_moved(run_id: str, event: RunEvent) -> Callable[[Tx], Awaitable[Any]]:
    """After a lost reply: the move landed (the run's state no longer takes ``event``:
    it moved on) or not (retry), as for an outcome."""

    async def settle(tx: Tx) -> Any:
        run = await load_run(tx, run_id)
        return (run, True) if _moved_on(RUN_TABLE, run.state, event) else RETRY

    return settle


def outcome_landed(op_id: str, update: OutcomeUpdate) -> Callable[[Tx], Awaitable[Any]]:
    """After a lost reply: the outcome landed (the status moved on) or not (retry)."""

    async def settle(tx: Tx) -> Any:
        op = await load_op(tx, op_id)
        return op if _moved_on(OPERATION_TABLE, op.status, update.event) else RETRY

    return settle


def logged(
    run_id: str, kind: str, token: str, answer: Callable[[Tx], Awaitable[Any]]
) -> Callable[[Tx], Awaitable[Any]]:
    """After a lost reply: a write that logs one ``kind`` event marked with its attempt
    ``token`` landed (that event is in the run's log: ``answer(tx)``) or not (retry).
    For writes whose state alone cannot tell (a phase entered again, an owner added
    again, an audit): run twice, each would log its event twice."""

    async def settle(tx: Tx) -> Any:
        if await attempt_logged(tx, run_id, kind, token):
            return await answer(tx)
        return RETRY

    return settle


async def settle_gates(doubts: dict[str, str], sessions: Sessions, tx: Tx) -> None:
    """Gates whose commit stayed in doubt (``doubts``: op id -> attempt token): what
    landed was never sent, so ``unknown``; once the sessions they went out on are gone.

    Single-flight: a transaction takes a doubt out of the map before settling it,
    so two concurrent ones never settle (or forget) the same one twice; a doubt
    whose settling fails goes back for the next transaction."""
    if sessions and not await sessions.gone(tx):
        return  # a gate may land yet: not now
    for op_id in list(doubts):
        token = doubts.pop(op_id, None)
        if token is None:
            continue  # another transaction took it meanwhile
        try:
            if await gate_committed(tx, op_id, token) is not None:
                op = await load_op(tx, op_id)
                if op.status is OpStatus.REQUESTED:
                    note = Evidence.local("gate_in_doubt", "intent commit in doubt; not dispatched")
                    await record(
                        tx, op_id, OutcomeUpdate(OpEvent.LOST, [note], cause=Cause.TRANSPORT)
                    )
        except BaseException:
            doubts.setdefault(op_id, token)
            raise
