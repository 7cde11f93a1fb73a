"""``FakeProvider``: a run's keys, from lists that grow and get replaced (``of_run``),
and what it keeps of each call."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import stopline
from stopline.testing import FakeProvider


def test_a_runs_keys_are_those_under_its_id_even_with_slashes_in_ids() -> None:
    provider = FakeProvider("p")
    provider.effects.extend(["a/1", "a/b/2", "ab/3", "a"])
    assert provider.of_run("effects", "a") == ["a/1", "a/b/2"]
    assert provider.of_run("effects", "a/b") == ["a/b/2"]  # a run id may hold "/"
    assert provider.of_run("effects", "ab") == ["ab/3"]
    assert provider.of_run("effects", "b") == []
    assert provider.of_run("requests", "a") == []  # each list its own


def test_a_runs_keys_follow_the_list_as_it_grows_shrinks_or_is_replaced() -> None:
    provider = FakeProvider("p")
    provider.requests.append("a/1")
    assert provider.of_run("requests", "a") == ["a/1"]
    provider.requests.extend(["b/1", "a/1"])  # a request seen twice
    assert provider.of_run("requests", "a") == ["a/1", "a/1"]
    provider.requests = ["a/2"]  # replaced (a provider loading its truth from a file)
    assert provider.of_run("requests", "a") == ["a/2"]
    provider.requests.clear()
    assert provider.of_run("requests", "a") == []


async def test_a_provider_keeps_a_keys_cancel_only_while_it_matters(tmp_path: Path) -> None:
    """Each call's cancel event was kept for the provider's life (a soak's worker held
    hundreds of thousands). A finished call's unset one is dropped; a cancelled key's
    stays, so a retry of it is still refused; a key is in progress until its last call
    is (two calls of one key overlap: the first to end no longer clears it)."""
    send = FakeProvider("send", cancellable=stopline.Cancellable.UNTIL_ACCEPTED)
    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}") as ledger:
        async with ledger.run("r", owner="u") as run:
            for i in range(50):
                await run.call(send.tool, i)
        assert send._cancelled == {} and send.in_progress == set()

        held = send.hold("received")
        async with ledger.run("c", owner="u") as run, anyio.create_task_group() as tg:

            async def call() -> None:
                with pytest.raises(stopline.StoplineError):
                    await run.call(send.tool, "x", key="k")

            tg.start_soon(call)
            await held.reached.wait()
            await ledger.cancel(run.id, by="u")
            held.release()
        key = f"{run.id}/k"
        assert send._cancelled[key].is_set() and key not in send.in_progress
