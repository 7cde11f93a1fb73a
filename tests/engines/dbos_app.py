"""The DBOS application of the engine tests: declared at import, as DBOS wants.

``report`` reads; ``upload`` and ``notify`` touch the world through the
provider the harness installs (``use``). ``pipeline`` runs them in order,
waiting for a ``go`` message first when asked; ``parent`` starts children.
"""

from __future__ import annotations

from typing import Any

from dbos import DBOS

from stopline import ReadBack
from stopline.integrations.dbos import StoplineDBOS, call_context
from stopline.runtime.context import CallContext
from tests.engines.provider import FileProvider

gate = StoplineDBOS(owner="user:42")
_provider: list[FileProvider] = []


def use(provider: FileProvider) -> None:
    _provider[:] = [provider]


async def _verify(ctx: CallContext) -> ReadBack:
    return await _provider[0].verify(ctx)


@DBOS.step()
@gate.step(effects=False)
async def report(topic: str) -> str:
    return f"report: {topic}"


@DBOS.step(preemptible=True)
@gate.step(description="upload the report", verify=_verify)
async def upload(payload: str) -> dict[str, Any]:
    return await _provider[0].send(call_context().key, payload)


@DBOS.step(retries_allowed=True, interval_seconds=0.05, backoff_rate=1.0, max_attempts=5)
@gate.step(description="notify the channel", verify=_verify)
async def notify(payload: str) -> dict[str, Any]:
    return await _provider[0].send(call_context().key, payload)


STEPS = {"report": report, "upload": upload, "notify": notify}


@DBOS.workflow()
@gate.workflow()
async def pipeline(steps: list[str], wait_for_go: bool = False) -> list[Any]:
    if wait_for_go:
        await DBOS.recv_async("go", timeout_seconds=60)
    out: list[Any] = []
    for name in steps:
        out.append(await STEPS[name](f"{name} of {DBOS.workflow_id}"))
    return out


@DBOS.workflow()
@gate.workflow(shared=True)
async def shared_child(steps: list[str]) -> list[Any]:
    await DBOS.recv_async("go", timeout_seconds=60)
    return [await STEPS[name](f"{name} of {DBOS.workflow_id}") for name in steps]


@DBOS.workflow()
@gate.workflow()
async def parent(steps: list[str]) -> None:
    await DBOS.start_workflow_async(pipeline, steps, True)
    await DBOS.start_workflow_async(shared_child, steps)
    await DBOS.recv_async("go", timeout_seconds=60)
