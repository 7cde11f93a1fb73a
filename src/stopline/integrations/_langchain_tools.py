"""What LangChain does with a tool before and while it runs, as the LangGraph gate needs it.

- ``fits``: whether ``ToolNode`` accepts the model's arguments (else it refuses them
  before the tool runs, and ``refusing`` stands in for the tool so it never runs
  ungated);
- ``runs_in_thread``: whether LangChain runs the call's body in an executor thread
  (a ``def`` tool). A cancel then stops only the waiting; the thread goes on and
  may commit, so the gate must keep the call to its end (R4), not read the
  destination back while the thread may still write to it.
"""

from __future__ import annotations

from typing import Any

from langchain_core.tools import BaseTool, StructuredTool, ToolException
from langchain_core.tools import Tool as FunctionTool
from pydantic import BaseModel, ValidationError

__all__ = ["fits", "refusing", "runs_in_thread"]


def runs_in_thread(tool: BaseTool) -> bool:
    """Whether ``tool.ainvoke`` runs the tool's body in an executor thread.

    ``StructuredTool`` and ``Tool`` (``Tool.from_function``) without a ``coroutine``
    run their whole ``invoke`` in one (their own ``ainvoke``), whatever their
    ``_arun``; with one, they await it. Any other ``BaseTool`` runs ``_run`` in one
    (``BaseTool._arun``) unless its class brings its own async path: ``_arun``,
    ``arun`` or ``ainvoke`` overridden. A class that overrides what these read is
    taken at its word: async.
    """
    cls = type(tool)
    for base in (StructuredTool, FunctionTool):
        if isinstance(tool, base):  # ``coroutine`` is a field of both
            return cls.ainvoke is base.ainvoke and tool.coroutine is None
    return (
        cls.ainvoke is BaseTool.ainvoke
        and cls.arun is BaseTool.arun
        and cls._arun is BaseTool._arun  # a subclass with only ``_run`` (LangChain's pattern)
    )


def fits(tool: BaseTool, args: Any) -> bool:
    """Whether the model's arguments fit the schema the tool showed it (its injected
    arguments left out). ``ToolNode`` refuses ones that do not before the tool runs."""
    schema = tool.tool_call_schema
    if tool.args_schema is None or not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        return True  # no model to check against: ``ToolNode``'s own check is the only one
    try:
        schema.model_validate(args)
    except ValidationError:
        return False
    return True


def refusing(tool: BaseTool) -> BaseTool:
    """A stand-in with ``tool``'s name and schema: ``ToolNode`` refuses the arguments to
    it as it would to ``tool``, with its own message (or its configured handling);
    should it not, the stand-in refuses, and ``tool`` never runs ungated."""

    def refuse(**kwargs: Any) -> Any:
        raise ToolException(f"stopline: the arguments do not fit {tool.name}'s schema")

    assert tool.args_schema is not None  # ``fits`` said so
    return StructuredTool(
        name=tool.name, description=tool.description, args_schema=tool.args_schema, func=refuse
    )
