"""A Temporal worker with the stopline plugin in a process of its own (the crash test).

python -m tests.engines.temporal_worker ADDRESS TASK_QUEUE LEDGER_URL EFFECTS_FILE [remote]

It says ``ready`` once polling and ``committed KEY`` after each effect, then
holds every response forever: the test kills it there. It caches no workflow (no
sticky queue), so the workflow's next task goes to the next worker at once. With
``remote`` its tools declare no horizon (a remote provider's: an activity's is its
attempt's bound), and it says ``reached received KEY`` and holds the first call
there, before any effect (a request on its way).
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
from temporalio.client import Client
from temporalio.worker import Worker

import stopline
from tests.engines.provider import FileProvider
from tests.engines.temporal_harness import activities, plugin
from tests.engines.temporal_workflows import Pipeline


def say(line: str) -> None:
    print(line, flush=True)


async def main(*argv: str) -> None:
    address, queue, url, effects, *mode = argv
    remote = mode == ["remote"]
    provider = FileProvider(Path(effects), announce=say)
    if remote:
        provider.barriers.on_reach = lambda at, key: say(f"reached {at} {key}")
    # never released: the response never leaves (remote: nor the request's effect)
    provider.barriers.hold("received" if remote else "responding")
    client = await Client.connect(address)
    async with stopline.open(url) as ledger:
        acts = activities(provider)
        async with Worker(
            client,
            task_queue=queue,
            workflows=[Pipeline],
            activities=acts,
            plugins=[plugin(ledger, provider, acts, settles_within=None if remote else 0.0)],
            # no sticky queue: a worker killed mid-call would hold its workflow's next task
            # on it until Temporal gives up on it (10 s), then hands it to the next worker
            max_cached_workflows=0,
        ):
            say("ready")
            await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:6])
