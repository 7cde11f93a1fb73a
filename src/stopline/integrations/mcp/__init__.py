"""Truthful cancellation for Model Context Protocol tool calls, both ends.

Client side: ``StoplineMCP`` wraps an MCP connection so that every
side-effecting ``tools/call`` is a stopline operation (gate first, the
idempotency key in ``_meta["io.stopline/key"]``, late answers kept,
progress recorded, causes told apart). Server side: ``Effects`` gives
``MCPServer`` tool authors idempotency by key, durable commits, the
``stopline_verify`` tool and a cancellation log. ``TasksServer`` and
``TasksClient`` implement the ``io.modelcontextprotocol/tasks`` extension.
See docs/mcp.md.
"""

from stopline.integrations.mcp._listing import index_tools
from stopline.integrations.mcp._verdicts import proves, takes_tool
from stopline.integrations.mcp._vocab import (
    ACCEPTED_MESSAGE,
    CANCELLABLE_META,
    EFFECTS_META,
    KEY_META,
    OUTCOME_DATA,
    REJECTED_CODE,
    TASKS_EXTENSION,
    TRACKED_META,
    VERIFY_TOOL,
    ToolPolicy,
    policy_from_listing,
)
from stopline.integrations.mcp.client import StoplineMCP, UnknownTool
from stopline.integrations.mcp.server import Effects, Operation, effect_meta, key_of
from stopline.integrations.mcp.tap import LateAnswer, LateResponseTap
from stopline.integrations.mcp.tasks import TasksServer, default_principal
from stopline.integrations.mcp.tasks_client import TasksClient

__all__ = [
    "ACCEPTED_MESSAGE",
    "CANCELLABLE_META",
    "EFFECTS_META",
    "KEY_META",
    "OUTCOME_DATA",
    "REJECTED_CODE",
    "TASKS_EXTENSION",
    "TRACKED_META",
    "VERIFY_TOOL",
    "Effects",
    "LateAnswer",
    "LateResponseTap",
    "Operation",
    "StoplineMCP",
    "TasksClient",
    "TasksServer",
    "ToolPolicy",
    "UnknownTool",
    "default_principal",
    "effect_meta",
    "index_tools",
    "key_of",
    "policy_from_listing",
    "proves",
    "takes_tool",
]
