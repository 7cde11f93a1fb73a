"""R11: a share's link names who made it, in the link's own transaction (ADR 0065, 5).

Before, an allowed share wrote two things one after the other: the link with its
``owner_added`` event (which owner, not who), then an ``audit`` event (who). A worker
killed between the two left a link nobody answered for: the run had one more owner,
which decided what stopped it, and the ledger could not say who had made it so. Now
``owner_added`` carries ``by``, written with the link; the second write is gone.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import stopline
from stopline.domain.vocab import LogKind
from tests.support.killed import run_until_then_kill

pytestmark = pytest.mark.timeout(60)

# A worker that shares ``S`` (its parent ``A``'s) with ``B`` as alice, and is killed as
# soon as the link's write has returned: before any later write of the share's.
WORKER = textwrap.dedent("""
    import sys
    import anyio, stopline
    from stopline.ledger.forwarding import ForwardingBackend

    class KilledAfterTheLink(ForwardingBackend):
        async def add_owner(self, *args, **kwargs):
            await self.inner.add_owner(*args, **kwargs)
            print("linked", flush=True)
            await anyio.sleep_forever()  # SIGKILL lands here

    async def main() -> None:
        async with stopline.open(sys.argv[1], observers=[KilledAfterTheLink]) as ledger:
            async with (
                ledger.run("a", owner="alice", run_id="A") as a,
                ledger.run("b", owner="alice", run_id="B") as b,
                ledger.run("s", owner="alice", run_id="S", parent_id=a.id, shared=True) as s,
            ):
                await ledger.share(s.id, with_owner=b.id, by="alice")

    anyio.run(main)
""")


async def test_a_share_names_who_made_it_even_if_its_worker_dies_right_after(
    tmp_path: Path, ledger_url: str
) -> None:
    await run_until_then_kill(tmp_path / "worker.py", WORKER, b"linked", ledger_url)
    async with stopline.open(ledger_url) as ledger:
        assert await ledger.backend.owners_of(["S"]) == {"S": {"A": False, "B": False}}
        (added,) = [e for e in await ledger.backend.events("S") if e.kind == LogKind.OWNER_ADDED]
        assert (added.data["owner"], added.data["by"]) == ("B", "alice")  # was: no "by"


async def test_an_allowed_share_writes_its_link_alone(ledger: stopline.Ledger) -> None:
    """The link's event is the share's record: no second ``audit`` event repeats it
    (the trail says it once, as a cancel's event says who cancelled)."""
    async with (
        ledger.run("a", owner="alice", run_id="A") as a,
        ledger.run("b", owner="alice", run_id="B") as b,
        ledger.run("s", owner="alice", run_id="S", parent_id=a.id, shared=True) as s,
    ):
        before = len(await ledger.backend.events(s.id))
        await ledger.share(s.id, with_owner=b.id, by="alice")
        (added,) = (await ledger.backend.events(s.id))[before:]
        assert added.kind == LogKind.OWNER_ADDED
        assert added.data["by"] == "alice"
        await ledger.cancel(a.id, by="alice")
        await ledger.cancel(b.id, by="alice")
