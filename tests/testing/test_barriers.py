"""Barriers: a hold stops the next call at its point until released."""

from __future__ import annotations

import anyio
import pytest

from stopline.testing.barriers import BarrierInUse, Barriers


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_release_all_lets_go_a_call_already_held() -> None:
    barriers = Barriers()
    hold = barriers.hold("accepted")
    passed = anyio.Event()

    async def call() -> None:
        await barriers.reach("accepted", "k1")
        passed.set()

    with anyio.fail_after(10):  # a guard: a call left held fails here
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await hold.reached.wait()
            barriers.release_all()
            await passed.wait()
    assert hold.released


async def test_a_second_hold_on_a_waiting_point_is_refused() -> None:
    barriers = Barriers()
    first = barriers.hold("accepted")
    with pytest.raises(BarrierInUse, match="'accepted' already has a hold waiting"):
        barriers.hold("accepted")
    first.release()
    await barriers.reach("accepted", "k1")  # the first hold, released: passes
    assert first.reached.is_set()
    barriers.hold("accepted")  # reached: the point may be held again
