"""Replay of a call proved ``committed`` by a read-back that returned no result: the
model of a resumed agent is told the call happened and its result was not kept,
never handed ``None`` (or ``null``) as if the tool had returned nothing.

Real agents with each framework's offline model (Pydantic AI's ``FunctionModel``,
the Agents SDK's ``ScriptedModel``, ``GenericFakeChatModel`` in a LangGraph graph);
real ledgers; barriers, never sleeps. The tool writes its effect, then waits for an
answer that never comes: the cancel cuts the wait, the verifier reads the effect
back (``committed``, no ``result``).
"""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

import anyio
import pytest
from agents import Agent as OAAgent
from agents import function_tool, set_tracing_disabled
from agents.testing import ScriptedModel, assistant_message, function_call
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.tools import tool as lc_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

import stopline
from stopline import OpStatus
from stopline.integrations import langgraph as lg
from stopline.integrations import openai_agents as oa
from stopline.integrations import pydantic_ai as pai

pytestmark = pytest.mark.timeout(30)


class Effect:
    """Writes its line, then waits for an answer the cancel cuts; read back by its lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.wrote = anyio.Event()
        self.answer = anyio.Event()  # never set: the cancel cuts the wait

    async def send(self, note: str) -> str:
        self.lines.append(note)
        self.wrote.set()
        await self.answer.wait()
        return f"sent {note}"

    async def read_back(self, ctx: stopline.CallContext) -> stopline.ReadBack:
        """Proves the effect; returns no result (it is not the tool's answer)."""
        verdict = stopline.Verdict.COMMITTED if self.lines else stopline.Verdict.NOT_COMMITTED
        return stopline.ReadBack(verdict, "outbox", "read back")


async def settled_by_read_back(ledger: stopline.Ledger, run_id: str, op_id: str) -> None:
    await ledger.wait_settled(run_id, timeout=10)
    op = await ledger.backend.get_operation(op_id)
    assert op.status is OpStatus.COMMITTED and not op.has_result  # the case under test
    await ledger.resume(run_id, by="user:1")


def says_not_kept(content: Any) -> None:
    assert isinstance(content, str), f"the model was handed {content!r}"
    assert "result was not kept" in content and "Do not call it again" in content


# -- Pydantic AI -------------------------------------------------------------------


def tool_returns(messages: list[ModelMessage]) -> list[Any]:
    return [
        part.content
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart)
    ]


class Ask:
    """Asks for ``send`` (id ``c<turn>``) until it has a return; keeps what it was handed."""

    def __init__(self) -> None:
        self.turns = 0
        self.seen: list[Any] = []

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.turns += 1
        done = tool_returns(messages)
        if done:
            self.seen = done
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart("send", {"note": "n1"}, f"c{self.turns}")])


async def pai_cut(ledger: stopline.Ledger, run_id: str) -> tuple[Agent[None, str], Ask, Effect]:
    effect, ask = Effect(), Ask()
    agent: Agent[None, str] = Agent(FunctionModel(ask))

    @agent.tool_plain
    async def send(note: str) -> str:
        """Send a note."""
        return await effect.send(note)

    sessions: list[pai.AgentSession] = []

    async def go() -> None:
        verify = {"send": effect.read_back}
        async with pai.run(ledger, owner="user:1", run_id=run_id, verify=verify) as s:
            sessions.append(s)
            await s.run(agent, "go")

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        await effect.wrote.wait()
        await sessions[0].cancel(by="user:1")
    await settled_by_read_back(ledger, run_id, f"{run_id}/tool:c1")
    return agent, ask, effect


async def test_pydantic_ai_history_repair_says_a_read_back_result_was_not_kept(
    ledger: stopline.Ledger,
) -> None:
    agent, ask, effect = await pai_cut(ledger, "p6r-pai-h")
    cut: list[ModelMessage] = [
        ModelRequest.user_text_prompt("go"),
        ModelResponse(parts=[ToolCallPart("send", {"note": "n1"}, tool_call_id="c1")]),
    ]
    verify = {"send": effect.read_back}
    async with pai.run(ledger, owner="user:1", run_id="p6r-pai-h", verify=verify) as s:
        await s.run(agent, message_history=await s.history(cut))
    (content,) = ask.seen  # what the model was handed as the call's return
    says_not_kept(content)
    assert effect.lines == ["n1"]


async def test_pydantic_ai_resume_without_history_says_a_read_back_result_was_not_kept(
    ledger: stopline.Ledger,
) -> None:
    agent, ask, effect = await pai_cut(ledger, "p6r-pai-n")
    verify = {"send": effect.read_back}
    async with pai.run(ledger, owner="user:1", run_id="p6r-pai-n", verify=verify) as s:
        await s.run(agent, "go")  # asked again under a new id: the recorded call
    (content,) = ask.seen
    says_not_kept(content)
    assert effect.lines == ["n1"]


# -- OpenAI Agents SDK -------------------------------------------------------------


async def test_openai_agents_resume_note_says_a_read_back_result_was_not_kept(
    ledger: stopline.Ledger,
) -> None:
    set_tracing_disabled(True)
    effect = Effect()
    send = function_tool(effect.send, name_override="send")
    first = ScriptedModel(
        [[function_call("send", {"note": "n1"}, call_id="c1")], [assistant_message("done")]]
    )
    sessions: list[oa.AgentSession] = []

    async def go() -> None:
        verify = {"send": effect.read_back}
        async with oa.run(ledger, owner="user:1", run_id="p6r-oa", verify=verify) as s:
            sessions.append(s)
            await s.stream(OAAgent(name="a", model=first, tools=[send]), "go")

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        await effect.wrote.wait()
        await sessions[0].cancel(by="user:1")
    await settled_by_read_back(ledger, "p6r-oa", "p6r-oa/tool:c1")
    again = ScriptedModel([[assistant_message("nothing to do")]])
    async with oa.run(ledger, owner="user:1", run_id="p6r-oa") as s:
        await s.stream(OAAgent(name="a", model=again, tools=[send]), "go")
    (note,) = [
        item["content"]
        for item in again.calls[0].input
        if isinstance(item, dict) and item.get("role") == "developer"
    ]
    (line,) = [line for line in note.splitlines() if "(tool:c1)" in line]
    assert "committed: completed; do not repeat it" in line  # the receipt's words (ADR 0121)
    assert "result was not kept" in line and "null" not in line
    assert effect.lines == ["n1"]


# -- LangGraph ---------------------------------------------------------------------


class Chat(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def replies() -> Any:
    call = {"name": "send", "args": {"note": "n1"}, "id": "c1", "type": "tool_call"}
    yield AIMessage(content="", tool_calls=[call])
    while True:
        yield AIMessage(content="done")


async def test_langgraph_replay_says_a_read_back_result_was_not_kept(
    ledger: stopline.Ledger,
) -> None:
    effect = Effect()

    @lc_tool
    async def send(note: str) -> str:
        """Send a note."""
        return await effect.send(note)

    model = GenericFakeChatModel(messages=replies())
    seen: list[Any] = []

    async def agent(state: Chat) -> dict[str, list[AnyMessage]]:
        seen[:] = [m.content for m in state["messages"] if isinstance(m, ToolMessage)]
        return {"messages": [await model.ainvoke(state["messages"])]}

    def route(state: Chat) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

    builder = StateGraph(Chat)
    builder.add_node("agent", agent)
    hook = lg.gate(verify={"send": effect.read_back})
    builder.add_node("tools", ToolNode([send], awrap_tool_call=hook))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", route, ["tools", END])
    builder.add_edge("tools", "agent")
    graph = builder.compile(checkpointer=InMemorySaver())
    runs: list[lg.GraphRun] = []

    async def go(graph_input: Any) -> None:
        async with lg.run(ledger, owner="user:1", thread_id="p6r-lg") as g:
            runs.append(g)
            await g.ainvoke(graph, graph_input)

    async with anyio.create_task_group() as tg:
        tg.start_soon(go, {"messages": [("user", "go")]})
        await effect.wrote.wait()
        await runs[0].cancel(by="user:1")
    await settled_by_read_back(ledger, "p6r-lg", "p6r-lg/tool:c1")
    await go(None)  # the thread resumed from its checkpoint: the tool node again
    (content,) = seen  # what the model was handed as the call's message
    says_not_kept(content)
    assert effect.lines == ["n1"]
