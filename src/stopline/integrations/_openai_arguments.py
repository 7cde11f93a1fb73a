"""What the OpenAI Agents SDK does with a model's tool arguments, for the adapter.

A function tool's arguments are parsed and checked by the SDK before the
function runs; what it refuses there did nothing, so the gated call is
``Rejected`` (``not_committed``), not an error in doubt. An MCP tool's arguments
are parsed here, before the gate: ones that are no JSON object make no request.

The gate compares a call's arguments as parsed (``json_value``): a model that
spells the same JSON another way (key order, spaces) makes the same call.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable
from typing import Any

from agents.exceptions import ModelBehaviorError

from stopline.runtime.tool import Rejected

__all__ = ["json_object", "json_value", "refusing_arguments"]

# how the SDK words its refusal of a model's arguments, raised before the function runs
_REFUSED = "Invalid JSON input for tool "


async def refusing_arguments(invoked: Awaitable[Any]) -> Any:
    """``invoked`` (the SDK's own invocation of a function tool); the SDK's refusal of
    the arguments (not JSON, not an object, not the tool's schema) as ``Rejected``."""
    try:
        return await invoked
    except ModelBehaviorError as exc:
        if not str(exc).startswith(_REFUSED):
            raise
        raise Rejected(f"the SDK refused the arguments: {exc}") from exc


def json_object(arguments: str) -> dict[str, Any] | None:
    """The arguments as the object an MCP request carries (``""`` is none), else ``None``."""
    with contextlib.suppress(ValueError):
        parsed = json.loads(arguments) if arguments else {}
        return parsed if isinstance(parsed, dict) else None
    return None


def json_value(arguments: str) -> Any:
    """The arguments a function tool's call digests: the JSON they spell (``""`` is
    ``{}``, as the SDK reads it), or, when they spell none, the text itself."""
    if not arguments:
        return {}
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
