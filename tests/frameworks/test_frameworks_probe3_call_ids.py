"""A LangGraph tool call id reached twice in one run (ADR 0054, ADR 0068).

An id names one operation: the same id with the same arguments is that call
again, whether ``ToolNode`` re-runs it from its checkpoint (a ``RetryPolicy``) or
a model emits it twice in one message, when ``ToolNode`` runs both at once; with
other arguments it is refused. Real graphs, real ``ToolNode``; real ledgers.
"""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from langgraph.types import RetryPolicy

import stopline
from stopline import OpStatus, RunState
from stopline.integrations import langgraph as sl

pytestmark = pytest.mark.timeout(30)


class Chat(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def call(name: str, args: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"name": name, "args": args, "id": call_id, "type": "tool_call"}


def graph_of(tools: list[Any], calls: list[dict[str, Any]], **node: Any) -> Any:
    """agent (asks for ``calls`` in one message) -> a gated ``ToolNode`` -> end."""

    async def agent(state: Chat) -> dict[str, Any]:
        return {"messages": [AIMessage("", tool_calls=calls)]}

    builder = StateGraph(Chat)
    builder.add_node("agent", agent)
    tool_node = ToolNode(tools, awrap_tool_call=sl.gate(), handle_tool_errors=False)
    builder.add_node("tools", tool_node, **node)
    builder.add_edge(START, "agent")
    builder.add_edge("agent", "tools")
    builder.add_edge("tools", END)
    return builder.compile(checkpointer=InMemorySaver())


def paying(paid: list[str], *, sync: bool) -> Any:
    if sync:

        @tool
        def pay(order: str) -> str:
            """Pay an order (a plain def: LangChain runs it in a thread)."""
            paid.append(order)
            return f"paid {order}"

        return pay

    @tool
    async def pay_async(order: str) -> str:
        """Pay an order."""
        paid.append(order)
        return f"paid {order}"

    pay_async.name = "pay"
    return pay_async


@pytest.mark.parametrize("sync", [False, True], ids=["async", "def"])
async def test_one_id_twice_in_a_message_with_the_same_arguments_is_one_call(
    ledger: stopline.Ledger, sync: bool
) -> None:
    """``ToolNode`` runs both at once: the second waits for the first and gets its record
    (as it would one after the other); it met the first in flight and failed "in doubt"."""
    paid: list[str] = []
    thread = f"lg-ids-twice-{'def' if sync else 'async'}"
    twice = [call("pay", {"order": "9"}, "c1"), call("pay", {"order": "9"}, "c1")]
    async with sl.run(ledger, owner="user:1", thread_id=thread) as g:
        state = await g.ainvoke(graph_of([paying(paid, sync=sync)], twice), {"messages": []})
    assert paid == ["9"]
    answers = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    assert [(m.tool_call_id, m.content) for m in answers] == [("c1", "paid 9"), ("c1", "paid 9")]
    (op,) = await ledger.backend.operations(thread)
    assert op.id == f"{thread}/tool:c1" and op.status is OpStatus.COMMITTED
    assert (await ledger.backend.get_run(thread)).state is RunState.COMPLETED


async def test_one_id_twice_in_a_message_with_other_arguments_is_refused(
    ledger: stopline.Ledger,
) -> None:
    """The second call under the id, with other arguments, is refused naming the reuse;
    the first is on record; nothing is sent for the second."""
    paid: list[str] = []
    twice = [call("pay", {"order": "9"}, "c1"), call("pay", {"order": "10"}, "c1")]
    with pytest.raises(stopline.InvalidInput, match="reuses the id"):
        async with sl.run(ledger, owner="user:1", thread_id="lg-ids-other") as g:
            await g.ainvoke(graph_of([paying(paid, sync=False)], twice), {"messages": []})
    assert paid == ["9"]
    (op,) = await ledger.backend.operations("lg-ids-other")
    assert op.status is OpStatus.COMMITTED


async def test_a_tool_node_rerun_from_its_checkpoint_repeats_nothing(
    ledger: stopline.Ledger,
) -> None:
    """A ``RetryPolicy`` re-runs the whole ``ToolNode`` under the same ids: the call that
    committed is replayed, the one that provably did nothing is sent again."""
    paid: list[str] = []
    refusals = ["card service busy"]

    @tool
    async def charge(order: str) -> str:
        """Charge an order; refuses before doing anything while the service is busy."""
        if refusals:
            raise stopline.Rejected(refusals.pop())
        return f"charged {order}"

    calls = [call("pay", {"order": "9"}, "c1"), call("charge", {"order": "9"}, "c2")]
    retry = RetryPolicy(
        max_attempts=2, initial_interval=0, jitter=False, retry_on=stopline.Rejected
    )
    graph = graph_of([paying(paid, sync=False), charge], calls, retry_policy=retry)
    async with sl.run(ledger, owner="user:1", thread_id="lg-ids-retry") as g:
        state = await g.ainvoke(graph, {"messages": []})
    assert paid == ["9"]  # once, though the node ran twice
    answers = {m.tool_call_id: m.content for m in state["messages"] if isinstance(m, ToolMessage)}
    assert answers == {"c1": "paid 9", "c2": "charged 9"}
    ops = {op.id: op.status for op in await ledger.backend.operations("lg-ids-retry")}
    assert ops == {
        "lg-ids-retry/tool:c1": OpStatus.COMMITTED,
        "lg-ids-retry/tool:c2": OpStatus.COMMITTED,
    }
