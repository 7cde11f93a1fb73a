"""The runtime's own barrier points, seen through the backend seam; and a crash switch.

The explorer opens its ledger with ``HookedBackend`` as an observer (the same
seam ``stopline.telemetry`` uses), so the runtime needs no test hooks:

- ``before_dispatch/<tool>``: a call is about to pass the gate;
- ``after_gate/<tool>``: its intent is durable, its first byte not yet sent;
- ``returned/<tool>``: a tool of the user's own returned its result, which the
  ledger has not recorded yet (a crash here leaves an effect only the tool's
  read-back can find; a ``FakeProvider``'s ``responding`` is that point already);
- ``response_delivered/<tool>``: its response is recorded, not yet returned.

Each hold is shielded: it models one instant of the runtime (its writes are
shielded too), so a cancel delivered meanwhile lands at the runtime's next
checkpoint, exactly as it would if it had arrived at that instant.

``crash()`` makes the backend behave as a killed process: every later call
raises ``WorkerCrashed`` and writes nothing. The ledger's own close then fails
at its first write, as a dead process's would; ``bury()`` closes the real
backend underneath (its connections and thread), writing nothing more.
"""

from __future__ import annotations

import anyio

from stopline.domain.model import OperationRecord, OperationSpec
from stopline.domain.vocab import OpEvent
from stopline.ledger.backend import Backend, GateResult, GateVerdict, OutcomeUpdate
from stopline.ledger.forwarding import ForwardingBackend
from stopline.testing.barriers import Barriers

__all__ = ["RUNTIME_POINTS", "HookedBackend", "Hooks", "WorkerCrashed"]

BEFORE_DISPATCH = "before_dispatch"
AFTER_GATE = "after_gate"
RETURNED = "returned"
RESPONSE_DELIVERED = "response_delivered"
RUNTIME_POINTS = (BEFORE_DISPATCH, AFTER_GATE, RETURNED, RESPONSE_DELIVERED)


class WorkerCrashed(BaseException):
    """The simulated worker process is gone: nothing it does reaches the ledger any more."""


class Hooks:
    """Barriers at the runtime's points, and the crash switch, for one ledger."""

    def __init__(self) -> None:
        self.barriers = Barriers()
        self.crashed = False
        self.tools: dict[str, str] = {}  # op id -> tool name, as seen at the gate
        # tools with a point of their own between effect and return (FakeProviders'
        # ``responding``): no ``returned`` point for them
        self.responding: set[str] = set()
        self._inner: Backend | None = None  # the real backend under the hooks

    def wrap(self, backend: Backend) -> Backend:
        self._inner = backend
        return HookedBackend(backend, self)

    async def bury(self) -> None:
        """Close the crashed worker's real backend: a killed process's files and
        threads are gone with it; nothing is written (only ``close``)."""
        inner, self._inner = self._inner, None
        if inner is not None:
            with anyio.CancelScope(shield=True):
                await inner.close()

    def crash(self) -> None:
        self.crashed = True

    def check(self) -> None:
        if self.crashed:
            raise WorkerCrashed("the worker process was killed")

    async def reach(self, point: str, tool: str, key: str) -> None:
        with anyio.CancelScope(shield=True):
            await self.barriers.reach(f"{point}/{tool}", key)
        self.check()


class HookedBackend(ForwardingBackend):
    """Every call checks the crash switch first; the gate and ``record`` hold at the points."""

    def __init__(self, inner: Backend, hooks: Hooks) -> None:
        super().__init__(inner)
        self._hooks = hooks

    @property
    def inner(self) -> Backend:
        self._hooks.check()  # a killed worker reaches the ledger no more
        return self._inner

    async def gate(self, spec: OperationSpec) -> GateResult:
        hooks = self._hooks
        hooks.check()
        hooks.tools[spec.id] = spec.tool
        await hooks.reach(BEFORE_DISPATCH, spec.tool, spec.id)
        result = await self.inner.gate(spec)
        hooks.check()
        if result.verdict is GateVerdict.PASSED:
            await hooks.reach(AFTER_GATE, spec.tool, spec.id)
        return result

    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        hooks = self._hooks
        hooks.check()
        tool = hooks.tools.get(op_id)
        returned = update.event is OpEvent.COMMITTED and not update.late
        if returned and tool is not None and tool not in hooks.responding:
            await hooks.reach(RETURNED, tool, op_id)
        op = await self.inner.record(op_id, update)
        hooks.check()
        if returned:
            await hooks.reach(RESPONSE_DELIVERED, tool or op.tool, op_id)
        return op

    @property
    def defers_outcomes(self) -> bool:  # type: ignore[override]
        return False  # every outcome is awaited, so it passes the points in order

    async def close(self) -> None:
        await self._inner.close()
