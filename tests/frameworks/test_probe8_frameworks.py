"""Probe 8 of the Agents SDK and LangGraph adapters, with real agents and graphs.

**The Agents SDK's tools that are no ``FunctionTool`` but run here.**

``gate_agent`` gated function tools and MCP tools and handed every other tool on as
it was. Four kinds of them run in the process itself: a ``CustomTool``
(``on_invoke_tool``), a local ``ShellTool`` or ``LocalShellTool`` (``executor``), a
``ComputerTool`` and an ``ApplyPatchTool``. Their calls had no record, ran after a
cancel's fence (``after_turn`` lets the turn's tools run), and a resume that asked
again ran them twice, under a receipt that said "Completed." with no line for them.
Now custom and shell calls pass the gate under ``tool:<call_id>``, and an agent with
a computer or an editor (whose calls reach the code without the model's call id) is
refused with ``InvalidInput`` unless the tool is named in ``reads`` (ADR 0094).

**``interrupt()`` in an ``sl.node`` body** (LangGraph). It was a pause only inside a
gated tool; in a gated node the bubble was an error of the call: ``unknown``, then
``needs_review``, and the resume (``Command(resume=...)``) raised ``OperationInDoubt``.
Now it is a pause there too: the attempt ``not_committed``, the run paused, and the
node's re-run on resume passes the gate under the same task key.

Real agents with the SDK's own ``ScriptedModel`` (the model's custom and shell calls
given as the stream's completed response); real ledgers; events as barriers.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Annotated, Any, TypedDict

import anyio
import pytest
from agents import (
    Agent,
    ApplyPatchTool,
    CustomTool,
    GuardrailFunctionOutput,
    LocalShellTool,
    Runner,
    ShellTool,
    WebSearchTool,
    function_tool,
    input_guardrail,
    set_tracing_disabled,
)
from agents.editor import ApplyPatchOperation
from agents.items import TResponseOutputItem
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseCustomToolCall,
    ResponseOutputItem,
)
from openai.types.responses.response_function_shell_tool_call import (
    Action,
    ResponseFunctionShellToolCall,
)
from openai.types.responses.response_output_item import LocalShellCall, LocalShellCallAction

import stopline
from stopline import Headline, InvalidInput, OpStatus, ReadBack, RunState, Verdict
from stopline.integrations import langgraph as lg
from stopline.integrations import openai_agents as sl
from tests.frameworks.effects import statuses

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def no_trace_export() -> None:
    set_tracing_disabled(True)


def streamed(items: Sequence[ResponseOutputItem]) -> ModelStep:
    """One model turn whose output is ``items``, streamed as its completed response (the
    SDK's automatic streaming covers function calls and messages only)."""
    response = Response(
        id="scripted-response",
        created_at=0,
        model="scripted-model",
        object="response",
        output=list(items),
        tool_choice="none",
        tools=[],
        top_p=None,
        parallel_tool_calls=True,
        status="completed",
    )
    done = ResponseCompletedEvent(type="response.completed", response=response, sequence_number=0)
    return ModelStep.stream([done])


def custom_call(call_id: str, text: str) -> ResponseCustomToolCall:
    return ResponseCustomToolCall(
        type="custom_tool_call", call_id=call_id, input=text, name="patch", id=f"i-{call_id}"
    )


def shell_call(call_id: str, command: str) -> ResponseFunctionShellToolCall:
    return ResponseFunctionShellToolCall(
        type="shell_call",
        id=f"i-{call_id}",
        call_id=call_id,
        status="completed",
        action=Action(commands=[command], timeout_ms=None, max_output_length=None),
        environment=None,
        created_by=None,
    )


def local_shell_call(call_id: str, command: str) -> LocalShellCall:
    action = LocalShellCallAction(command=[command], env={}, type="exec")
    return LocalShellCall(
        type="local_shell_call",
        id=f"i-{call_id}",
        call_id=call_id,
        status="completed",
        action=action,
    )


class Effects:
    """The ground truth: what each tool really did, in order."""

    def __init__(self) -> None:
        self.done: list[tuple[str, Any]] = []

    async def custom(self, ctx: Any, text: str) -> str:
        self.done.append(("patch", text))
        return f"patched {text}"

    async def shell(self, request: Any) -> str:
        self.done.append(("shell", request.data.action.commands))
        return "ran"

    def local_shell(self, request: Any) -> str:  # a ``def`` executor: the SDK calls it inline
        self.done.append(("local_shell", request.data.action.command))
        return "ran locally"


async def test_custom_and_shell_calls_pass_the_gate(ledger: stopline.Ledger) -> None:
    effects = Effects()
    tools: list[Any] = [
        CustomTool(name="patch", description="apply a patch", on_invoke_tool=effects.custom),
        ShellTool(executor=effects.shell),
        LocalShellTool(executor=effects.local_shell),
    ]
    turn: list[TResponseOutputItem] = [
        custom_call("c1", "x=1"),
        shell_call("c2", "echo hi"),
        local_shell_call("c3", "ls"),
    ]
    model = ScriptedModel([streamed(turn), [assistant_message("done")]])
    agent = Agent(name="ops", model=model, tools=tools)
    async with sl.run(ledger, owner="user:1", run_id="local-1") as s:
        result = await s.stream(agent, "go")
    assert result.final_output == "done"
    assert sorted(effects.done) == [
        ("local_shell", ["ls"]),
        ("patch", "x=1"),
        ("shell", ["echo hi"]),
    ]
    assert await statuses(ledger, "local-1") == {
        "tool:c1": OpStatus.COMMITTED,
        "tool:c2": OpStatus.COMMITTED,
        "tool:c3": OpStatus.COMMITTED,
    }
    lines = {line.op_id: line.text() for line in (await ledger.receipt("local-1")).lines}
    assert lines["local-1/tool:c1"].startswith("- patch: completed")
    assert lines["local-1/tool:c2"].startswith("- shell: completed")


async def test_after_turn_cancel_refuses_the_turns_next_custom_call(
    ledger: stopline.Ledger,
) -> None:
    """R1: the turn's custom calls run one after the other; the cancel lands during the
    first, ``after_turn`` lets it finish, and the second does not run (it ran, ungated)."""
    effects = Effects()
    reached, release = anyio.Event(), anyio.Event()

    async def patch(ctx: Any, text: str) -> str:
        if text == "first":
            reached.set()
            await release.wait()
        return await effects.custom(ctx, text)

    tool = CustomTool(name="patch", description="apply a patch", on_invoke_tool=patch)
    turn: list[TResponseOutputItem] = [custom_call("c1", "first"), custom_call("c2", "second")]
    model = ScriptedModel([streamed(turn), [assistant_message("done")]])
    agent = Agent(name="ops", model=model, tools=[tool])
    sessions: list[sl.AgentSession] = []

    async def go() -> None:
        async with sl.run(ledger, owner="user:1", run_id="local-2") as s:
            sessions.append(s)
            await s.stream(agent, "go")

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        await reached.wait()
        await sessions[0].cancel(by="user:1", mode="after_turn")
        release.set()
    await ledger.wait_settled("local-2", timeout=10)
    assert effects.done == [("patch", "first")]  # nothing after the fence
    recorded = await statuses(ledger, "local-2")
    assert recorded.pop("tool:c1") is OpStatus.COMMITTED
    # the second call was refused at the gate, or never reached it (the SDK's run
    # stopped at the fence the first call's answer met): no effect either way
    assert recorded in ({}, {"tool:c2": OpStatus.PREVENTED})
    assert (await ledger.backend.get_run("local-2")).state is RunState.CANCELLED


async def test_a_resume_asking_again_repeats_no_shell_command(ledger: stopline.Ledger) -> None:
    """R14: the model, asked again after the cancel, sends the same command under a new
    call id; it is the recorded call, answered from its record, never run twice."""
    effects = Effects()
    thinking = anyio.Event()

    async def held_model(call: Any) -> list[TResponseOutputItem]:
        thinking.set()
        await anyio.sleep_forever()  # cancelled with the run
        raise AssertionError("unreachable")

    tools: list[Any] = [ShellTool(executor=effects.shell)]
    first = ScriptedModel([streamed([shell_call("c1", "deploy")]), ModelStep(responder=held_model)])
    sessions: list[sl.AgentSession] = []

    async def go() -> None:
        async with sl.run(ledger, owner="user:1", run_id="local-3") as s:
            sessions.append(s)
            await s.stream(Agent(name="ops", model=first, tools=tools), "deploy")

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        await thinking.wait()  # the command ran; the model is thinking
        await sessions[0].cancel(by="user:1")
    await ledger.wait_settled("local-3", timeout=10)
    await ledger.resume("local-3", by="user:1")

    again = ScriptedModel([streamed([shell_call("c9", "deploy")]), [assistant_message("done")]])
    async with sl.run(ledger, owner="user:1", run_id="local-3") as s:
        result = await s.stream(Agent(name="ops", model=again, tools=tools), "deploy")
    assert result.final_output == "done"
    assert effects.done == [("shell", ["deploy"])]  # once
    assert await statuses(ledger, "local-3") == {"tool:c1": OpStatus.COMMITTED}


class Editor:
    """An ``ApplyPatchEditor`` that records what it was asked to do."""

    def __init__(self) -> None:
        self.done: list[str] = []

    def create_file(self, operation: ApplyPatchOperation) -> str:
        self.done.append(operation.path)
        return "created"

    def update_file(self, operation: ApplyPatchOperation) -> str:
        self.done.append(operation.path)
        return "updated"

    def delete_file(self, operation: ApplyPatchOperation) -> str:
        self.done.append(operation.path)
        return "deleted"


async def test_a_tool_whose_calls_cannot_be_keyed_is_refused_before_anything_runs(
    ledger: stopline.Ledger,
) -> None:
    editor = Editor()
    model = ScriptedModel([[assistant_message("done")]])
    agent = Agent(name="ops", model=model, tools=[ApplyPatchTool(editor=editor)])
    with pytest.raises(InvalidInput, match=r"apply_patch.*ApplyPatchTool.*reads="):
        async with sl.run(ledger, owner="user:1", run_id="local-4") as s:
            await s.stream(agent, "go")
    assert not model.calls  # refused before the model was asked
    assert await statuses(ledger, "local-4") == {}


async def test_reads_names_a_tool_run_outside_the_gate_and_hosted_tools_pass(
    ledger: stopline.Ledger,
) -> None:
    """What the caller declared (``reads``) and what runs at the provider are handed on as
    they are (the guard: this held before)."""
    tools: list[Any] = [ApplyPatchTool(editor=Editor()), WebSearchTool()]
    model = ScriptedModel([[assistant_message("done")]])
    agent = Agent(name="ops", model=model, tools=tools)
    async with sl.run(ledger, owner="user:1", run_id="local-5", reads={"apply_patch"}) as s:
        result = await s.stream(agent, "go")
    assert result.final_output == "done"
    assert (await ledger.backend.get_run("local-5")).state is RunState.COMPLETED


async def test_a_custom_tool_that_raises_is_recorded_then_told_as_the_sdk_tells_it(
    ledger: stopline.Ledger,
) -> None:
    """Recorded before the SDK turns the error into text for the model: ``unknown`` (then
    verified, here reviewed: no read-back), never ``completed``."""

    async def patch(ctx: Any, text: str) -> str:
        raise RuntimeError("the patch server hung up")

    tool = CustomTool(name="patch", description="apply a patch", on_invoke_tool=patch)
    model = ScriptedModel([streamed([custom_call("c1", "x=1")]), [assistant_message("done")]])
    async with sl.run(ledger, owner="user:1", run_id="local-6") as s:
        result = await s.stream(Agent(name="ops", model=model, tools=[tool]), "go")
    assert result.final_output == "done"
    told = [item.output for item in result.new_items if getattr(item, "output", None)]
    assert any("the patch server hung up" in str(output) for output in told)
    await ledger.wait_settled("local-6", timeout=10)
    assert await statuses(ledger, "local-6") == {"tool:c1": OpStatus.NEEDS_REVIEW}


async def test_a_guardrails_own_agent_gates_the_tools_it_is_given_with_sl_gated(
    ledger: stopline.Ledger,
) -> None:
    """An agent a guardrail runs itself (``Runner.run``) is not the run's gated copy: its
    tools pass the gate when they are ``sl.gated`` (the guard, as documented: this held)."""
    effects = Effects()

    @function_tool
    async def flag(reason: str) -> str:
        """Flag the request."""
        effects.done.append(("flag", reason))
        return "flagged"

    checker = Agent(
        name="checker",
        model=ScriptedModel(
            [[function_call("flag", {"reason": "odd"}, call_id="g1")], [assistant_message("ok")]]
        ),
        tools=[sl.gated(flag)],
    )

    @input_guardrail
    async def check(ctx: Any, agent: Any, text: Any) -> GuardrailFunctionOutput:
        await Runner.run(checker, text, context=ctx.context)
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered=False)

    model = ScriptedModel([[assistant_message("done")]])
    agent = Agent(name="ops", model=model, input_guardrails=[check])
    async with sl.run(ledger, owner="user:1", run_id="local-7") as s:
        await s.stream(agent, "go")
    assert effects.done == [("flag", "odd")]
    assert await statuses(ledger, "local-7") == {"tool:g1": OpStatus.COMMITTED}


# -- LangGraph: interrupt() inside an ``sl.node`` body ------------------------------------


class Order(TypedDict, total=False):
    order: str
    done: Annotated[list[str], operator.add]


def approval_graph(refunds: list[str], *, sync: bool) -> Any:
    """One gated node that asks a person (``interrupt()``) before it refunds."""

    def decide(state: Order) -> dict[str, list[str]]:
        if interrupt({"refund": state["order"]}):
            refunds.append(state["order"])
            return {"done": [f"refunded {state['order']}"]}
        return {"done": ["declined"]}

    async def decide_async(state: Order) -> dict[str, list[str]]:
        return decide(state)

    builder = StateGraph(Order)
    builder.add_node("refund", lg.node(decide) if sync else lg.node(decide_async))
    builder.add_edge(START, "refund")
    builder.add_edge("refund", END)
    return builder.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize("sync", [False, True], ids=["async-node", "def-node"])
async def test_interrupt_in_a_gated_node_is_a_pause_and_the_resume_runs_it_once(
    ledger: stopline.Ledger, sync: bool
) -> None:
    """It was recorded ``unknown`` ("may have happened; verifying") though the node only
    asked a person, then ``needs_review``; the resume raised ``OperationInDoubt`` and the
    run failed, the approved refund never made. Now: ``not_committed``, the run paused;
    resumed with ``Command(resume=True)``, the node runs under the same key, once."""
    refunds: list[str] = []
    graph = approval_graph(refunds, sync=sync)
    async with lg.run(ledger, owner="user:1", thread_id="lg-node-int") as g:
        first = await g.ainvoke(graph, {"order": "1042"})
    assert "__interrupt__" in first and refunds == []
    (op,) = await ledger.backend.operations("lg-node-int")
    assert op.status is OpStatus.NOT_COMMITTED  # it asked, nothing was done
    receipt = await ledger.receipt("lg-node-int")
    assert receipt.run_state is RunState.PAUSED and receipt.headline is Headline.PAUSED

    await ledger.resume("lg-node-int", by="user:1")
    async with lg.run(ledger, owner="user:1", thread_id="lg-node-int") as g:
        state = await g.ainvoke(graph, Command(resume=True))
    assert state["done"] == ["refunded 1042"]
    assert refunds == ["1042"]
    (after,) = await ledger.backend.operations("lg-node-int")
    assert after.id == op.id and after.status is OpStatus.COMMITTED
    assert (await ledger.backend.get_run("lg-node-int")).state is RunState.COMPLETED


async def test_a_custom_call_cut_by_the_cancel_is_read_back_by_the_runs_verify(
    ledger: stopline.Ledger,
) -> None:
    """``verify=`` on ``sl.run`` names a custom or shell tool as it names a function
    tool: the call cut by the cancel is ``unknown``, then proven by its read-back."""
    truth: dict[str, str] = {}
    applied = anyio.Event()

    async def patch(ctx: Any, text: str) -> str:
        truth["patch"] = text
        applied.set()
        await anyio.sleep_forever()  # the answer never comes back
        raise AssertionError("unreachable")

    async def read_back(ctx: stopline.CallContext) -> ReadBack:
        found = "patch" in truth
        return ReadBack(Verdict.COMMITTED if found else Verdict.NOT_COMMITTED, "patch:1")

    tool = CustomTool(name="patch", description="apply a patch", on_invoke_tool=patch)
    model = ScriptedModel([streamed([custom_call("c1", "x=1")]), [assistant_message("done")]])
    agent = Agent(name="ops", model=model, tools=[tool])
    sessions: list[sl.AgentSession] = []

    async def go() -> None:
        verify = {"patch": read_back}
        async with sl.run(ledger, owner="user:1", run_id="local-8", verify=verify) as s:
            sessions.append(s)
            await s.stream(agent, "go")

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        await applied.wait()
        await sessions[0].cancel(by="user:1")
    receipt = await ledger.wait_settled("local-8", timeout=10)
    (op,) = await ledger.backend.operations("local-8")
    kinds = [e.kind for e in await ledger.backend.events("local-8") if e.op_id == op.id]
    assert kinds.index("lost") < kinds.index("verified_committed")  # unknown, then proven
    assert op.status is OpStatus.COMMITTED
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
