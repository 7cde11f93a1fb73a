"""The runtime's own barrier points, seen through the backend seam; and a crash switch.

The explorer opens its ledger with ``HookedBackend`` as an observer (the same
seam ``stopline.telemetry`` uses), so the runtime needs no test hooks:

- ``before_dispatch/<tool>``: a call is about to pass the gate;
- ``after_gate/<tool>``: its intent is durable, its first byte not yet sent;
- ``response_delivered/<tool>``: its response is recorded, not yet returned.

Each hold is shielded: it models one instant of the runtime (its writes are
shielded too), so a cancel delivered meanwhile lands at the runtime's next
checkpoint, exactly as it would if it had arrived at that instant.

``crash()`` makes the backend behave as a killed process: every later call
raises ``WorkerCrashed`` and writes nothing; only ``close`` still works.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from stopline.domain.model import OperationRecord, OperationSpec
from stopline.domain.vocab import OpEvent
from stopline.ledger.backend import Backend, GateResult, GateVerdict, OutcomeUpdate
from stopline.testing.barriers import Barriers

__all__ = ["RUNTIME_POINTS", "HookedBackend", "Hooks", "WorkerCrashed"]

BEFORE_DISPATCH = "before_dispatch"
AFTER_GATE = "after_gate"
RESPONSE_DELIVERED = "response_delivered"
RUNTIME_POINTS = (BEFORE_DISPATCH, AFTER_GATE, RESPONSE_DELIVERED)


class WorkerCrashed(BaseException):
    """The simulated worker process is gone: nothing it does reaches the ledger any more."""


class Hooks:
    """Barriers at the runtime's points, and the crash switch, for one ledger."""

    def __init__(self) -> None:
        self.barriers = Barriers()
        self.crashed = False
        self.tools: dict[str, str] = {}  # op id -> tool name, as seen at the gate

    def wrap(self, backend: Backend) -> Backend:
        # abstract to mypy only: the seam's other methods are forwarded below the class
        return HookedBackend(backend, self)  # type: ignore[abstract]

    def crash(self) -> None:
        self.crashed = True

    def check(self) -> None:
        if self.crashed:
            raise WorkerCrashed("the worker process was killed")

    async def reach(self, point: str, tool: str, key: str) -> None:
        with anyio.CancelScope(shield=True):
            await self.barriers.reach(f"{point}/{tool}", key)
        self.check()


class HookedBackend(Backend):
    def __init__(self, inner: Backend, hooks: Hooks) -> None:
        self.inner = inner
        self.location = inner.location
        self._hooks = hooks

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
        op = await self.inner.record(op_id, update)
        hooks.check()
        if update.event is OpEvent.COMMITTED and not update.late:
            await hooks.reach(RESPONSE_DELIVERED, hooks.tools.get(op_id, op.tool), op_id)
        return op

    def __getattr__(self, name: str) -> Any:
        # methods the backend seam gains later (review, recovery) pass straight through
        return getattr(self.inner, name)

    async def close(self) -> None:
        await self.inner.close()


def _forwarder(name: str) -> Callable[..., Awaitable[Any]]:
    async def forward(self: HookedBackend, *args: Any, **kwargs: Any) -> Any:
        self._hooks.check()
        return await getattr(self.inner, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    return forward


# Every other method of the seam, today's and those it gains later, is forwarded as is
# (after the crash check); names the seam does not declare pass through ``__getattr__``.
for _name in sorted(Backend.__abstractmethods__ - set(vars(HookedBackend))):
    setattr(HookedBackend, _name, _forwarder(_name))
HookedBackend.__abstractmethods__ = frozenset()
