"""A run as the workflow sees it: phases, gated calls, boundaries.

``Run.call`` is the dispatch gate's caller. For an effectful tool it records
the intent through the gate (one durable transaction) before the tool's
first byte leaves, then records what the call proved: ``committed`` on a
response, ``not_committed`` only on a provider's refusal, and ``unknown`` on
anything else (R3). A cancel reaches a call according to the phase policy:
``immediate`` interrupts it, ``at_boundary`` and ``verify`` let it finish and
stop the run right after (the provider is asked to cancel meanwhile when it
can).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from stopline.domain.limits import check_id
from stopline.domain.model import Evidence, OperationRecord, OperationSpec, RunRecord, digest
from stopline.domain.vocab import Cause, EvidenceKind, OpEvent, OpStatus, PhaseKind, Policy
from stopline.errors import OperationInDoubt, RunFenced
from stopline.ledger.backend import GateVerdict, OutcomeUpdate
from stopline.runtime.context import CallContext
from stopline.runtime.lifecycle import ApprovalNeeded, Retry
from stopline.runtime.tool import NoAnswer, Rejected, Tool

if TYPE_CHECKING:
    from stopline.domain.lifecycle import ApprovalRecord, Checkpoint
    from stopline.domain.receipt import Receipt
    from stopline.runtime.ledger import Ledger
    from stopline.runtime.scope import RunScope

__all__ = ["INTERRUPTED", "Run"]

INTERRUPTED = "local abort: the call was interrupted"

R = TypeVar("R")
_REPLAYABLE = frozenset({OpStatus.COMMITTED, OpStatus.COMPENSATING, OpStatus.COMPENSATED})


class Run:
    """Handle on one run inside ``async with ledger.run(...) as run``."""

    def __init__(self, ledger: Ledger, record: RunRecord) -> None:
        self._ledger = ledger
        self.id = record.id
        self.name = record.name
        self.owner = record.owner
        self.tenant = record.tenant
        self.record = record  # as created or attached: who owns it and in which tenant
        self.policy = record.policy
        self.phase_kind: PhaseKind | None = record.phase
        self._seq = 0
        self._scope: anyio.CancelScope | None = None
        self._inflight: dict[str, CallContext] = {}
        # "a cancel was asked for" (committed to the ledger) ...
        self.cancel_requested = False
        # ... kept apart from "this run's work was interrupted" (cancelled_caught).
        self.cancelled_caught = False
        self.pause_requested = False
        # the workflow stopped to wait (a human's approval): its block ends, the run stays paused
        self.suspended = False

    # -- the gate's caller ---------------------------------------------------
    async def call(
        self,
        tool: Tool[R] | Callable[..., Awaitable[R]],
        *args: Any,
        key: str | None = None,
        timeout: float | None = None,
        needs_approval: bool = False,
        retry: Retry | None = None,
        **kwargs: Any,
    ) -> R:
        """Run a tool. Effectful tools pass the gate first; reads go straight through.

        ``key`` names the operation (its idempotency key; by default the call's
        position in the run, so a replay recognises it). ``needs_approval``: the
        gate lets it pass only with a granted, unexpired approval for ``key``.
        ``retry``: further attempts after a refusal, each through the gate.
        """
        t: Tool[R] = tool if isinstance(tool, Tool) else self._ledger.adopt(tool)
        if not t.effects:
            return await t.fn(*args, **kwargs)
        self._seq += 1
        op_id = check_id("key", f"{self.id}/{key if key is not None else f'{self._seq}:{t.name}'}")
        self._ledger.register_tool(t)
        spec = OperationSpec(
            id=op_id,
            run_id=self.id,
            tool=t.name,
            args_digest=digest([args, kwargs]),
            description=t.description,
            cancellable=t.cancellable,
            can_verify=t.verify_fn is not None,
            can_compensate=t.compensate_fn is not None,
            worker=self._ledger.worker_id,
            needs_approval=needs_approval,
        )
        if retry is None:
            return await self._gated(t, spec, args, kwargs, timeout, replayed=False)
        for delay in [*retry.delays(), None]:
            try:
                return await self._gated(t, spec, args, kwargs, timeout, replayed=False)
            except (Rejected, NoAnswer, TimeoutError, ConnectionError):
                if delay is None:
                    raise
            await anyio.sleep(delay)  # the next attempt passes the gate again (R1)
        raise AssertionError("unreachable")

    async def _gated(
        self,
        t: Tool[R],
        spec: OperationSpec,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        *,
        replayed: bool,
    ) -> R:
        gate = await self._ledger.backend.gate(spec)
        while gate.verdict is GateVerdict.PAUSED:
            await self._ledger.wait_for_change(self.id)
            gate = await self._ledger.backend.gate(spec)
        if gate.verdict is GateVerdict.PREVENTED:
            self.cancel_requested = True
            raise RunFenced(self.id, spec.id)
        if gate.verdict is GateVerdict.NEEDS_APPROVAL:
            raise ApprovalNeeded(spec.id, await self._ledger.why_not_approved(self.id, spec.id))
        if gate.verdict is GateVerdict.EXISTING:
            assert gate.operation is not None
            op = gate.operation
            if op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW) and not replayed:
                # in doubt: read back first (R5, reads only); retry only if it never happened
                op = await self._ledger.verify(op.id)
                if op.status is OpStatus.NOT_COMMITTED:
                    return await self._gated(t, spec, args, kwargs, timeout, replayed=True)
            return self._replay(op)  # type: ignore[no-any-return]
        ctx = CallContext(self._ledger, self.id, spec.id, t)  # type: ignore[arg-type]
        if self.cancel_requested:
            # the cancel landed between our gate and our first byte: nothing left
            not_sent = Evidence.local("not_dispatched", "cancelled before sending")
            update = OutcomeUpdate(OpEvent.NOT_SENT, [not_sent], cause=Cause.USER_CANCEL)
            await self._ledger._resolve(spec.id, update)
            raise RunFenced(self.id, spec.id)
        self._inflight[spec.id] = ctx
        try:
            result = await self._dispatch(t, ctx, args, kwargs, timeout)
        except Exception as exc:
            if self.cancel_requested:  # the provider's answer to our cancel: unwind quietly
                raise RunFenced(self.id, spec.id) from exc
            raise
        finally:
            del self._inflight[spec.id]
        if self.cancel_requested:
            raise RunFenced(self.id)  # the boundary after a recorded response
        return result

    def _replay(self, op: OperationRecord) -> Any:
        """R10: a committed operation is never repeated; its recorded result is returned."""
        if op.status in _REPLAYABLE:
            return op.result
        if op.status is OpStatus.PREVENTED:
            self.cancel_requested = True
            raise RunFenced(self.id, op.id)
        raise OperationInDoubt(op.id, op.status)

    async def _dispatch(
        self,
        t: Tool[R],
        ctx: CallContext,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
    ) -> R:
        ledger = self._ledger
        call_args = (ctx, *args) if t.wants_context else args
        try:
            if timeout is None:
                result = await t.fn(*call_args, **kwargs)
            else:
                with anyio.fail_after(timeout):
                    result = await t.fn(*call_args, **kwargs)
        except anyio.get_cancelled_exc_class():
            if not ctx.lost_recorded:  # else the cancel recorded it, in bulk with its tree
                cause = Cause.USER_CANCEL if self.cancel_requested else Cause.LOCAL_ERROR
                with anyio.CancelScope(shield=True):
                    await ledger._lost(ctx, cause, INTERRUPTED)
            raise
        except Rejected as exc:
            evidence = [Evidence(EvidenceKind.PROVIDER_RECEIPT, exc.ref or "rejected", exc.reason)]
            await ledger._outbox.record(
                ctx.op_id,
                OutcomeUpdate(
                    OpEvent.REJECTED, evidence, cause=Cause.SERVER_ERROR, error=exc.reason
                ),
            )
            raise
        except NoAnswer as exc:
            await ledger._lost(ctx, exc.cause, exc.detail)
            raise
        except TimeoutError:
            await ledger._lost(ctx, Cause.TIMEOUT, f"no answer within {timeout}s")
            raise
        except (ConnectionError, OSError) as exc:
            await ledger._lost(ctx, Cause.TRANSPORT, f"{type(exc).__name__}: {exc}")
            raise
        except Exception as exc:
            await ledger._lost(ctx, Cause.LOCAL_ERROR, f"{type(exc).__name__}: {exc}")
            raise
        evidence = [Evidence(EvidenceKind.RESPONSE_DIGEST, digest(result))]
        if ctx.provider_ref and not ctx._accepted:  # else recorded at acceptance already
            evidence.insert(0, Evidence(EvidenceKind.PROVIDER_RECEIPT, ctx.provider_ref))
        update = OutcomeUpdate(OpEvent.COMMITTED, evidence, result=result, has_result=True)
        if not ledger.durable_outcomes and ledger.backend.defers_outcomes:
            # queued in order now, committed with the next group commit (ADR 0022)
            ledger._recording.add(ctx.op_id)
            ledger.backend.record_deferred(
                ctx.op_id, update, functools.partial(ledger._recorded, ctx.op_id, update)
            )
        else:
            await ledger._outbox.record(ctx.op_id, update)  # held if the ledger cannot take it
        return result

    # -- phases and boundaries -------------------------------------------------
    @contextlib.asynccontextmanager
    async def phase(self, kind: PhaseKind, policy: Policy | None = None) -> AsyncIterator[None]:
        """A named stretch with its cancel policy; entering and leaving are boundaries."""
        self.boundary()
        previous = (self.phase_kind, self.policy)
        self.phase_kind, self.policy = kind, policy or kind.default_policy
        await self._ledger.backend.set_phase(self.id, kind, self.policy)
        try:
            yield
        finally:
            self.phase_kind, self.policy = previous
        self.boundary()

    def child(self, name: str, *, shared: bool = False, run_id: str | None = None) -> RunScope:
        """A sub-agent's run, owned by this one (exclusively unless ``shared``)."""
        return self._ledger.run(
            name,
            owner=self.owner,
            tenant=self.tenant,
            run_id=run_id,
            parent_id=self.id,
            shared=shared,
        )

    async def checkpoint(self, name: str, state: Any = None) -> Checkpoint:
        """An evidenced checkpoint (R10): refused while any operation is unresolved."""
        return await self._ledger.backend.checkpoint(self.id, name, state)

    async def request_approval(self, key: str, *, approver: str) -> ApprovalRecord:
        """Ask ``approver`` for the operation ``key`` (call it with ``needs_approval=True``)."""
        return await self._ledger.request_approval(self.id, key, approver=approver, by=self.owner)

    async def suspend(self, reason: str) -> Receipt:
        """Stop here without ending: the run is paused (R9) and leaving its block does not
        complete it. For a workflow that waits for a person (an approval, an answer); it
        continues after ``ledger.resume`` in a new block on the same run id."""
        self.suspended = True
        return await self._ledger.pause(self.id, by=self.owner, reason=reason)

    def boundary(self) -> None:
        """A safe point: raise ``RunFenced`` if a cancel was committed."""
        if self.cancel_requested:
            raise RunFenced(self.id)

    async def receipt(self) -> Receipt:
        return await self._ledger.receipt(self.id)

    # -- delivery of a committed cancel (called by the ledger) -----------------
    def _deliver_cancel(self) -> bool:
        """Interrupt by policy: ``immediate`` always; ``verify`` when no call is in flight
        (nothing to prove); ``at_boundary`` never (the step finishes, the next boundary stops).
        """
        self.cancel_requested = True
        interrupt = self.policy is Policy.IMMEDIATE or (
            self.policy is Policy.VERIFY and not self._inflight
        )
        if self._scope is not None and interrupt:
            self._scope.cancel()
            return True
        return False
