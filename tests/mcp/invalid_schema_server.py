"""A stdio MCP server, on the SDK's low-level ``Server``, that lists tools whose
``inputSchema`` no client can use as a JSON Schema, each as a server might list it,
beside one that is fine (``count``: an integer ``n``):

- ``stamp``: a type that does not exist (``"integr"``): the schema is invalid;
- ``letters``: an ECMAScript pattern (``\\p{L}``, as zod writes it) Python's ``re``
  cannot compile: invalid for a Python validator;
- ``itself``: a schema that refers to itself whole (``"$ref": "#"``): valid, and
  validating with it never ends;
- ``nowhere``: a ``$ref`` to a definition it does not hold;
- ``elsewhere``: a ``$ref`` to a schema at a URL (nothing listens there).

(The SDK's own models refuse a listing whose schema has no ``type`` or a ``$schema``
that is no string: such a server cannot be opened at all, ADR 0117.)

And tools whose answer does not fit the ``outputSchema`` they list, which the SDK's
client checks after the answer came (the tool ran):

- ``misfit``: answers ``{"n": "x"}`` for an integer ``n``;
- ``bare``: lists an ``outputSchema`` and answers no structured content;
- ``loop_out``: an ``outputSchema`` that refers to itself whole.

Each tool runs: it appends ``{"tool", "arguments", "key"}`` (the key from
``_meta["io.stopline/key"]``) to the JSON-lines log given as the first argument, then
answers ``{"stamped": <tool>}``. The log is the test's ground truth of what ran.
``slow`` first reads the named pipe its ``pipe`` argument names (the test opening it
for writing is the barrier that the call is in flight; closing it lets it answer).

    python tests/mcp/invalid_schema_server.py LOG
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

SCHEMAS: dict[str, dict[str, Any]] = {
    "count": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    "stamp": {"type": "object", "properties": {"n": {"type": "integr"}}},
    "letters": {
        "type": "object",
        "properties": {"word": {"type": "string", "pattern": "^\\p{L}+$"}},
    },
    "itself": {"type": "object", "$ref": "#"},
    "nowhere": {"type": "object", "properties": {"n": {"$ref": "#/$defs/missing"}}},
    "elsewhere": {"type": "object", "properties": {"n": {"$ref": "http://127.0.0.1:9/n.json"}}},
}


COUNTED = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
OUTPUTS: dict[str, dict[str, Any]] = {
    "misfit": COUNTED,
    "bare": COUNTED,
    "loop_out": {"type": "object", "$ref": "#"},
}
ANSWERS: dict[str, dict[str, Any] | None] = {"misfit": {"n": "x"}, "bare": None}


def main(log: Path) -> None:
    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        tools = [types.Tool(name=name, input_schema=schema) for name, schema in SCHEMAS.items()]
        anything = {"type": "object"}
        for name, output in OUTPUTS.items():
            tools.append(types.Tool(name=name, input_schema=anything, output_schema=output))
        tools.append(types.Tool(name="slow", input_schema=anything))
        return types.ListToolsResult(tools=tools)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        meta = dict(params.meta or {})
        entry = {
            "tool": params.name,
            "arguments": params.arguments,
            "key": meta.get("io.stopline/key"),
        }
        if params.name == "slow":
            pipe = str((params.arguments or {})["pipe"])
            await anyio.to_thread.run_sync(Path(pipe).read_text)
        with log.open("a") as out:
            out.write(json.dumps(entry) + "\n")
        stamped = ANSWERS.get(params.name, {"stamped": params.name})
        if stamped is None:
            text = types.TextContent(type="text", text="no structure")
            return types.CallToolResult(content=[text])
        text = types.TextContent(type="text", text=json.dumps(stamped))
        return types.CallToolResult(content=[text], structured_content=stamped)

    server: Server[Any] = Server(
        "invalid-schemas", on_list_tools=list_tools, on_call_tool=call_tool
    )

    async def serve() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(serve)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
