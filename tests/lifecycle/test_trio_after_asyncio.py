"""A process that ran stopline on asyncio, then on trio (anyio lets one application do
both): a task of the asyncio loop whose held-back cancel was asked for again
(``ledger._redeliver.REARMED``, ADR 0080) is still referenced when the trio ledger
writes. Every write on trio asked asyncio for its current task and raised
``RuntimeError: no running event loop``: opening the ledger failed (seen in the
suite, where the tests run in a random order in one process)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import anyio

import stopline
from stopline import OpStatus
from stopline.ledger._redeliver import REARMED


def test_a_trio_ledger_writes_after_an_asyncio_task_was_rearmed(tmp_path: Path) -> None:
    async def rearmed_on_asyncio() -> asyncio.Task[Any]:
        task = asyncio.current_task()
        assert task is not None
        REARMED.add(task)  # as ``holding`` leaves a task whose cancel it asked for again
        return task

    kept = asyncio.run(rearmed_on_asyncio())  # still referenced: still in the set
    assert kept in REARMED

    @stopline.tool
    async def send(ctx: stopline.CallContext, text: str) -> str:
        return f"sent {text}"

    async def on_trio() -> OpStatus:
        async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
            async with ledger.run("job", owner="user:1", run_id="r-trio") as run:
                assert await run.call(send, "hello", key="k") == "sent hello"
            return (await ledger.backend.get_operation("r-trio/k")).status

    try:
        assert anyio.run(on_trio, backend="trio") is OpStatus.COMMITTED
    finally:
        REARMED.discard(kept)
