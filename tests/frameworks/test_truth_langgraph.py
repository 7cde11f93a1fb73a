"""Issue 20 for a LangGraph agent's tool: the truth matrix, printed
(tests/support/truth_frameworks.py). The graph is model -> ``ToolNode`` -> model;
the model is ``langchain_core``'s own ``GenericFakeChatModel``, offline, and the
``ToolNode`` is gated by ``sl.gate(verify=..., cancel=...)``. The bare baseline is
the same graph with a plain ``ToolNode``. ``STOPLINE_TRUTH_MATRIX=full`` runs every
policy and verifier at every point.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage
from langchain_core.tools import InjectedToolCallId
from langchain_core.tools import tool as lc_tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode

import stopline
from stopline.integrations import langgraph as sl
from tests.support.truth_frameworks import Thinking, check_family
from tests.support.truth_tools import Provider

FULL = os.environ.get("STOPLINE_TRUTH_MATRIX") == "full"
pytestmark = pytest.mark.timeout(600 if FULL else 120)


class Chat(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


@dataclasses.dataclass
class PayGraph:
    """The agent's parts; compiled with the ``ToolNode`` hook of whoever runs it."""

    provider: Provider
    mode: str
    tool: str
    run_id: str
    thinking: Thinking

    def compile(self, hook: Any = None) -> Any:
        def replies() -> Iterator[AIMessage]:
            call = {"name": self.tool, "args": {"amount": 5}, "id": "c1", "type": "tool_call"}
            yield AIMessage(content="", tool_calls=[call])
            while True:
                yield AIMessage(content="paid")

        model = GenericFakeChatModel(messages=replies())

        async def agent(state: Chat) -> dict[str, list[AnyMessage]]:
            if not any(isinstance(m, ToolMessage) for m in state["messages"]):
                await self.thinking()
            return {"messages": [await model.ainvoke(state["messages"])]}

        @lc_tool(self.tool)
        async def pay(amount: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
            """Pay."""
            key = f"{self.run_id}/tool:{tool_call_id}"
            return str(await self.provider.pay(key, amount, self.mode))

        def route(state: Chat) -> str:
            last = state["messages"][-1]
            return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

        builder = StateGraph(Chat)
        builder.add_node("agent", agent)
        builder.add_node("tools", ToolNode([pay], awrap_tool_call=hook))
        builder.add_edge(START, "agent")
        builder.add_conditional_edges("agent", route, ["tools", END])
        builder.add_edge("tools", "agent")
        return builder.compile()


@dataclasses.dataclass
class Session:
    """The stopline run on the graph's thread and the hook's ``verify=`` / ``cancel=``."""

    graph_run: sl.GraphRun
    settings: dict[str, Any]

    async def cancel(self, *, by: str) -> Any:
        return await self.graph_run.cancel(by=by)


class LangGraph:
    name = "langgraph"

    def agent(
        self, provider: Provider, mode: str, tool: str, run_id: str, thinking: Thinking
    ) -> PayGraph:
        return PayGraph(provider, mode, tool, run_id, thinking)

    @asynccontextmanager
    async def session(
        self,
        ledger: stopline.Ledger,
        run_id: str,
        policy: stopline.Policy,
        settings: dict[str, Any],
    ) -> AsyncIterator[Session]:
        async with sl.run(ledger, owner="user:1", thread_id=run_id, policy=policy) as g:
            yield Session(g, settings)

    async def run(self, session: Session, agent: PayGraph) -> None:
        graph = agent.compile(sl.gate(**session.settings))
        await session.graph_run.ainvoke(graph, {"messages": [HumanMessage("pay 5")]})

    async def bare(self, agent: PayGraph) -> None:
        await agent.compile().ainvoke({"messages": [HumanMessage("pay 5")]})


async def test_issue20_langgraph_tool_truth_matrix(tmp_path: Path) -> None:
    await check_family(LangGraph(), tmp_path, FULL)
