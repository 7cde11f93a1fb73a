"""``sl.tool`` over any LangChain ``BaseTool`` (ADR 0068).

A user's own ``BaseTool`` subclass or ``Tool.from_function`` was refused with a
``TypeError``: it could not be gated at all. Now it runs as it is (its own
``ainvoke``), each call an operation under ``tool:<tool_call_id>``: a ``def`` body
is kept to its end (R4), an async one is read back, a resume repeats nothing; its
own argument refusal records nothing; its own error message is not "completed".
Real graphs (``tests.frameworks.test_langgraph_gate``), real ledgers, barriers.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool, ToolException
from pydantic import BaseModel

import stopline
from stopline import Headline, OpStatus
from stopline.integrations import langgraph as sl
from tests.frameworks.effects import FileEffect, until_unknown
from tests.frameworks.test_langgraph_gate import (
    Graph,
    Workflow,
    async_basetool,
    other_def_tool,
    resume,
    start,
)

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("kind", ["basetool", "function-tool"])
async def test_a_def_base_tool_cancelled_in_its_thread_keeps_its_late_result(
    ledger: stopline.Ledger, tmp_path: Path, kind: str
) -> None:
    """``sl.tool(WriteNote())``: cancelled while its ``_run`` is in its thread, the late
    write is attached (committed); the resumed thread replays it: one write."""
    thread = f"lg-bt-s09-{kind}"
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        plain, args = other_def_tool(effect, kind)
        graph = Graph(sl.tool(plain), args=args)
        workflow = Workflow()
        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow, ledger, graph.graph, start(), thread)
            await effect.wait_reached()
            await workflow.g.cancel(by="user:1")
            await until_unknown(ledger, f"{thread}/tool:c1")
            effect.release.set()
        receipt = await ledger.wait_settled(thread, timeout=10)
    assert effect.lines() == ["refund 9"]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    (op,) = await ledger.backend.operations(thread)
    assert op.status is OpStatus.COMMITTED and op.result == "wrote refund 9"

    state = await resume(ledger, graph.graph, None, thread)
    assert effect.lines() == ["refund 9"]
    told = [m.content for m in state["messages"] if isinstance(m, ToolMessage)]
    assert told == ["wrote refund 9"]


async def test_an_async_base_tool_cancelled_is_read_back_then_written_once(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """``sl.tool(WriteNote(), verify=...)`` with its own ``_arun``: the cancel interrupts
    it, the read-back proves nothing was written, the resume writes once."""
    thread = "lg-bt-s02"
    with FileEffect(tmp_path / "notes.txt", hold=True) as effect:
        graph = Graph(sl.tool(async_basetool(effect), verify=effect.read_back()))
        workflow = Workflow()
        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow, ledger, graph.graph, start(), thread)
            await effect.async_reached.wait()
            await workflow.g.cancel(by="user:1")
        receipt = await ledger.wait_settled(thread, timeout=10)
        (op,) = await ledger.backend.operations(thread)
        assert op.id == f"{thread}/tool:c1" and op.status is OpStatus.NOT_COMMITTED
        assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION

        effect.hold = False
        await resume(ledger, graph.graph, None, thread)
    assert effect.lines() == ["refund 9"]


async def test_a_base_tool_keeps_its_own_argument_check_and_records_nothing(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """Arguments the tool's schema refuses: the tool's own refusal, told to the model;
    no operation, nothing written."""
    effect = FileEffect(tmp_path / "notes.txt")

    class Note(BaseModel):
        note: str

    class WriteNote(BaseTool):
        name: str = "write_note"
        description: str = "Write a note."
        args_schema: type[BaseModel] = Note

        def _run(self, note: str) -> str:
            return effect.write(note)

    graph = Graph(sl.tool(WriteNote()), args={"memo": "x"})
    workflow = Workflow()
    await workflow(ledger, graph.graph, start(), "lg-bt-args")
    assert await ledger.backend.operations("lg-bt-args") == []
    assert effect.lines() == []
    (told,) = [m for m in workflow.output["messages"] if isinstance(m, ToolMessage)]
    assert told.status == "error"


async def test_a_base_tool_error_it_handles_itself_is_not_completed(
    ledger: stopline.Ledger,
) -> None:
    """A ``BaseTool`` with ``handle_tool_error``: its error message reaches the model as
    the tool made it, and the call is recorded in doubt, never "completed"."""

    class Charge(BaseTool):
        name: str = "write_note"
        description: str = "Charge a card."
        handle_tool_error: bool = True

        def _run(self, note: str) -> str:
            raise NotImplementedError("async only")

        async def _arun(self, note: str) -> str:
            raise ToolException("the card service timed out")

    workflow = Workflow()
    await workflow(ledger, Graph(sl.tool(Charge())).graph, start(), "lg-bt-raise")
    (told,) = [m for m in workflow.output["messages"] if isinstance(m, ToolMessage)]
    assert told.status == "error" and told.content == "the card service timed out"
    (op,) = await ledger.backend.operations("lg-bt-raise")
    kinds = [e.kind for e in await ledger.backend.events("lg-bt-raise") if e.op_id == op.id]
    assert "committed" not in kinds
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)
