"""A DBOS process with the gate bound (the crash test): starts one workflow and dies.

python -m tests.engines.dbos_worker SYSTEM_URL SCHEMA LEDGER_URL EFFECTS_FILE WORKFLOW_ID [POINT]

It says ``committed KEY`` after each effect and holds every response forever:
the test kills it there. With ``POINT`` (``received``: before any effect) it says
``reached POINT KEY`` and holds the first call there forever instead. With
``parent`` it starts ``parent`` instead (an exclusive child and a shared one, all
three waiting for "go") and says ``started``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
from dbos import DBOS, SetWorkflowID

from tests.engines import dbos_app
from tests.engines.dbos_harness import Databases, running
from tests.engines.provider import FileProvider


def say(line: str) -> None:
    print(line, flush=True)


async def main(*argv: str) -> None:
    system_url, schema, ledger_url, effects, workflow_id, *point = argv
    parent = point == ["parent"]
    provider = FileProvider(Path(effects), announce=say)
    if point and not parent:
        provider.barriers.on_reach = lambda at, key: say(f"reached {at} {key}")
    provider.barriers.hold(point[0] if point and not parent else "responding")  # never released
    async with running(Databases(system_url, schema, ledger_url), provider):
        with SetWorkflowID(workflow_id):
            if parent:
                await DBOS.start_workflow_async(dbos_app.parent, ["upload"])
                say("started")
            else:
                await DBOS.start_workflow_async(dbos_app.pipeline, ["upload", "notify"])
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:7])
