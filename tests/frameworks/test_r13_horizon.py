"""R13 for framework tools: a read-back's "not found" is "not yet" until the tool's
horizon, which the adapters now take (``settles_within={name: seconds}``).

A tool (Pydantic AI, the Agents SDK, LangGraph; the agents of their truth
families) whose provider refuses to cancel is cut under ``immediate``;
the read-back (found / not found, as a user writes one) looks while the provider
still holds the request, and only then is the provider let go: it commits. With
the tool's horizon the receipt says committed; without one, the first "not
found" would have been taken as proof, a false claim.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from stopline import OpStatus, Policy, ReadBack, Verdict
from tests.conftest import FAST_VERIFY
from tests.frameworks.test_truth_langgraph import LangGraph
from tests.frameworks.test_truth_openai_agents import OpenAIAgents
from tests.frameworks.test_truth_pydantic_ai import PydanticAI
from tests.support.truth_frameworks import Framework, Thinking
from tests.support.truth_tools import Provider


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    "framework", [PydanticAI(), OpenAIAgents(), LangGraph()], ids=lambda f: str(f.name)
)
async def test_r13_framework_tool_not_found_before_its_horizon_is_not_yet(
    framework: Framework, tmp_path: Path
) -> None:
    run_id, tool = f"r13-{framework.name}", "pay"
    key = f"{run_id}/tool:c1"
    looked = anyio.Event()
    async with anyio.create_task_group() as provider_tg:
        provider = Provider(provider_tg)

        async def find(ctx: stopline.CallContext) -> ReadBack:
            found = provider.find(ctx.key)
            if found is None:
                looked.set()  # "not found", while the provider still holds the request
                return ReadBack(Verdict.NOT_COMMITTED, ref=f"provider:{ctx.key}")
            return ReadBack(Verdict.COMMITTED, ref=f"provider:{ctx.key}", result=found)

        agent = framework.agent(provider, "pay_refusing", tool, run_id, Thinking(held=False))
        provider.hold(key, "50")
        url = f"sqlite:///{tmp_path / 'ledger.db'}"
        async with stopline.open(url, verify=FAST_VERIFY) as ledger:
            settings: dict[str, Any] = {"verify": {tool: find}, "settles_within": {tool: 3.0}}
            async with (
                framework.session(ledger, run_id, Policy.IMMEDIATE, settings) as s,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(framework.run, s, agent)
                await provider.reached(key, "50")
                await s.cancel(by="user:1")  # immediate: the call is cut
            with anyio.fail_after(30):  # a hang guard: the read-back looks at once
                await looked.wait()
            provider.release(key, "50")  # it refused the cancel: it goes on and commits
            receipt = await ledger.wait_settled(run_id, timeout=30)
        assert await provider.outcome(key) == 1
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
