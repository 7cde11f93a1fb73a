"""A remote with its own ground truth that can also be corrected, for the truth tests."""

from __future__ import annotations

from typing import Any

import anyio
from anyio import wait_all_tasks_blocked

import stopline
from stopline import ReadBack, Verdict
from stopline.runtime.tool import Compensation


class Remote:
    """Commits by key; corrects by the correction's key; answers read-backs of both."""

    def __init__(
        self,
        name: str = "book",
        *,
        compensation: Compensation = Compensation.NEVER,
        verifiable: bool = True,
        refuse_correction: bool = False,
    ) -> None:
        self.committed: dict[str, Any] = {}
        self.sent: list[str] = []  # every write that reached the remote, corrections too
        self.corrected: dict[str, str] = {}  # correction key -> the key it corrected
        self.correcting = anyio.Event()  # set when a correction starts
        self.let_correct = anyio.Event()  # a correction waits for this
        self.refuse_correction = refuse_correction
        self.tool: stopline.Tool[Any] = stopline.Tool(
            self._call, name=name, description=name, compensation=compensation
        )
        self.tool.wants_context = True
        if verifiable:
            self.tool.verify_fn = self._verify
        self.tool.compensate_fn = self._correct
        self.tool.compensation_verify_fn = self._verify_correction

    async def _call(self, ctx: stopline.CallContext, payload: Any = None) -> Any:
        self.sent.append(ctx.key)
        self.committed[ctx.key] = payload
        return {"id": ctx.key, "value": payload}

    async def _verify(self, ctx: stopline.CallContext) -> ReadBack:
        if ctx.key in self.committed:
            return ReadBack(Verdict.COMMITTED, f"{ctx.key}", "found by key")
        return ReadBack(Verdict.NOT_COMMITTED, detail="no such key")

    async def _correct(self, ctx: stopline.CallContext) -> Any:
        original = getattr(ctx, "compensates", None)
        assert isinstance(original, str)
        self.sent.append(ctx.key)
        self.correcting.set()
        await self.let_correct.wait()
        if self.refuse_correction:
            raise stopline.Rejected("too late to refund", ref=f"refund:{ctx.key}")
        self.corrected[ctx.key] = original
        return {"refund": original}

    async def _verify_correction(self, ctx: stopline.CallContext) -> ReadBack:
        if ctx.key in self.corrected:
            return ReadBack(Verdict.COMMITTED, f"refund:{ctx.key}")
        return ReadBack(Verdict.UNKNOWN, detail="refund not seen yet")


async def quiesce(ledger: stopline.Ledger) -> None:
    """Until every background step of the ledger (verify, settle, correct) is done.

    ``wait_all_tasks_blocked`` lets a step that was spawned but not yet started
    begin (and count itself busy); ``wait_idle`` then waits for the steps to end.
    """
    with anyio.fail_after(60):  # a hang guard, not a timing: a loaded machine is slow
        while True:
            await wait_all_tasks_blocked()
            if ledger.idle:
                return
            await ledger.wait_idle()
