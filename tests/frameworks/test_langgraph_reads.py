"""A LangGraph tool declared without effects (``sl.tool(fn, effects=False)``) in a real
graph: every call of it failed.

Its stopline tool was made as an effectful one's, its function taking the call's
context first, while a call without effects has none: the model's first argument
was taken for the context (``InvalidInput`` naming ``arguments``, "missing a
required argument: 'ctx'"), a ``def``'s and an ``async def``'s alike, and a
``BaseTool``'s went through the gate's recording path. Now a read runs as it is
while it is awaited (a ``def`` in a worker thread), nothing recorded; one that asks
for a context is refused when it is declared.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool
from langchain_core.tools import tool as lc_tool

import stopline
from stopline import Headline, InvalidInput
from stopline.integrations import langgraph as sl
from tests.frameworks.test_langgraph_gate import Graph, Workflow, start

pytestmark = pytest.mark.timeout(30)


def reads(kind: str, seen: list[str]) -> Any:
    """A read named as the fake model calls it (``write_note``, ``{"note": ...}``)."""
    if kind == "def":

        @lc_tool("write_note")
        def look_up(note: str) -> str:
            """Look a note up (a plain def: it runs in a thread)."""
            seen.append(note)
            return f"found {note}"

        return look_up
    if kind == "async":

        @lc_tool("write_note")
        async def look_up_async(note: str) -> str:
            """Look a note up."""
            seen.append(note)
            return f"found {note}"

        return look_up_async

    class LookUp(BaseTool):
        name: str = "write_note"
        description: str = "Look a note up."

        def _run(self, note: str) -> str:
            seen.append(note)
            return f"found {note}"

    return LookUp()


@pytest.mark.parametrize("kind", ["def", "async", "basetool"])
async def test_a_tool_without_effects_answers_in_a_graph_and_records_nothing(
    ledger: stopline.Ledger, kind: str
) -> None:
    thread = f"lg-read-{kind}"
    seen: list[str] = []
    graph = Graph(sl.tool(reads(kind, seen), effects=False))
    workflow = Workflow()
    await workflow(ledger, graph.graph, start(), thread)
    assert seen == ["refund 9"]
    told = [m for m in workflow.output["messages"] if isinstance(m, ToolMessage)]
    assert [(m.content, m.status) for m in told] == [("found refund 9", "success")]
    assert await ledger.backend.operations(thread) == []  # a read: nothing recorded
    receipt = await ledger.wait_settled(thread, timeout=10)
    assert receipt.headline is Headline.COMPLETED and receipt.lines == ()


def test_a_tool_without_effects_asking_for_a_call_context_is_refused() -> None:
    """Nothing is recorded for a read's call: it has no context to give, and its first
    argument would have been taken for one. Refused when it is declared, naming why."""

    @lc_tool
    async def look_up(ctx: stopline.CallContext, note: str) -> str:
        """Look a note up."""
        return note

    with pytest.raises(InvalidInput) as refused:
        sl.tool(look_up, effects=False)
    assert refused.value.what == "tool" and "no call context" in str(refused.value)
