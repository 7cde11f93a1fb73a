"""A framework's ``def`` tool is made a stopline tool for each call (ADR 0086).

The ledger reads an operation back with the first tool of its name; a ``def`` tool's
read-back is its worker thread (it waits for the answer). That thread was known to
the tool of its own call only: a second call of the same tool, cancelled while its
thread ran, was read back by the first call's tool, which answered "not run in this
process" while the thread was running. Now a ledger's threads in flight are the
ledger's: any tool made from the declaration reads back any of its calls. A real
LangGraph graph (``GenericFakeChatModel``), a real SQLite ledger.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import anyio
import anyio.to_thread
import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AnyMessage
from langchain_core.tools import tool as lc_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode

import stopline
from stopline import OpStatus, Verdict
from stopline.integrations import langgraph as sl
from tests.frameworks.effects import until_unknown

pytestmark = pytest.mark.timeout(30)


class Chat(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def twice() -> Iterator[AIMessage]:
    """The fake model: ``write_note`` (c1), then again (c2), then it answers."""
    for n in (1, 2):
        call = {"name": "write_note", "args": {"note": f"n{n}"}, "id": f"c{n}"}
        yield AIMessage(content="", tool_calls=[{**call, "type": "tool_call"}])
    while True:
        yield AIMessage(content="done")


def graph_of(tool: Any) -> Any:
    model = GenericFakeChatModel(messages=twice())

    async def agent(state: Chat) -> dict[str, list[AnyMessage]]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    def route(state: Chat) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

    builder = StateGraph(Chat)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode([tool], awrap_tool_call=sl.gate()))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", route, ["tools", END])
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=InMemorySaver())


async def test_a_second_call_of_a_def_tool_is_read_back_from_its_own_thread(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    written = tmp_path / "notes.txt"
    reached, release = threading.Event(), threading.Event()

    @lc_tool
    def write_note(note: str) -> str:
        """Write a note (a plain def: LangGraph runs it in a thread)."""
        if note == "n2":  # the second call waits in its thread
            reached.set()
            release.wait(20)
        with written.open("a") as f:
            f.write(note + "\n")
        return f"wrote {note}"

    thread = "lg-p4-twice"
    answers: list[stopline.ReadBack] = []
    asked = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:

            async def work() -> None:
                async with sl.run(ledger, owner="user:1", thread_id=thread) as g:
                    runs.append(g)
                    await g.ainvoke(graph_of(write_note), {"messages": [("user", "notes")]})

            runs: list[sl.GraphRun] = []
            tg.start_soon(work)
            await anyio.to_thread.run_sync(reached.wait, 20)
            # the tool the ledger reads ``write_note`` back with: the first call's
            known = ledger.core.tools["write_note"]
            read_back = known.verify_fn
            assert read_back is not None

            async def watched(ctx: stopline.CallContext) -> stopline.ReadBack | stopline.Verdict:
                asked.set()  # its lookup of the call is made before this task yields
                answer = stopline.ReadBack.of(await read_back(ctx))
                answers.append(answer)
                return answer

            known.verify_fn = watched
            await runs[0].cancel(by="user:1")
            await until_unknown(ledger, f"{thread}/tool:c2")
            await asked.wait()  # read back while the thread still runs
            release.set()
        await ledger.wait_settled(thread, timeout=10)
    finally:
        release.set()
    assert written.read_text().splitlines() == ["n1", "n2"]
    first = answers[0]  # it waited for the thread: no "not run in this process"
    assert first.verdict is Verdict.COMMITTED and first.ref == "worker-thread", first
    op = await ledger.backend.get_operation(f"{thread}/tool:c2")
    assert op.status is OpStatus.COMMITTED and op.result == "wrote n2"
