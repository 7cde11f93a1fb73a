"""A provider that logs its own commits to a file: the ground truth of the engine tests.

Every effect is one line appended and fsynced before the response, so the
file tells what really happened, across processes and crashes, whatever the
worker or the engine believe. It is deliberately not idempotent by key: a
duplicate effect shows as a second line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stopline import ReadBack, Rejected, Tool, Verdict
from stopline.runtime.context import CallContext
from stopline.testing import Barriers


class FileProvider:
    def __init__(self, path: Path, announce: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.barriers = Barriers()
        # a cross-process barrier: a worker in a subprocess says where it is on stdout
        self.announce = announce
        self.reject_next = False  # a fault: refuse the next request before any effect

    async def send(self, key: str, payload: Any) -> dict[str, Any]:
        await self.barriers.reach("received", key)
        if self.reject_next:
            self.reject_next = False
            raise Rejected("refused before any effect", ref=f"file:{key}")
        with self.path.open("a") as log:
            log.write(json.dumps({"key": key, "payload": payload}) + "\n")
            log.flush()
            os.fsync(log.fileno())
        if self.announce is not None:
            self.announce(f"committed {key}")
        await self.barriers.reach("committed", key)
        await self.barriers.reach("responding", key)
        return {"id": key, "payload": payload}

    def effects(self) -> list[str]:
        """Every committed key, in order (a duplicate shows twice)."""
        if not self.path.exists():
            return []
        return [json.loads(line)["key"] for line in self.path.read_text().splitlines()]

    async def verify(self, ctx: CallContext) -> ReadBack:
        """The read-back by idempotency key: reads only (R5)."""
        if ctx.key in self.effects():
            payload = {"id": ctx.key, "found": True}
            return ReadBack(Verdict.COMMITTED, f"file:{ctx.key}", "found in the log", payload)
        return ReadBack(Verdict.NOT_COMMITTED, f"file:{ctx.key}", "not in the log")

    def tool(
        self,
        name: str,
        fn: Callable[..., Any],
        description: str = "",
        settles_within: float | None = 0.0,
    ) -> Tool[Any]:
        """What the activity or step ``name`` declares: verifiable by key. By default
        in-process: nothing of it lands after its code stopped; ``settles_within=None``
        declares no horizon, as a remote provider's tool may (a Temporal activity's is
        then its attempt's bound, R13)."""
        declared: Tool[Any] = Tool(
            fn, name=name, description=description or name, settles_within=settles_within
        )
        declared.verify_fn = self.verify
        return declared
