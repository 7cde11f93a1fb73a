"""A stdio MCP server that crash-loops while a flag file exists.

``python -m tests.faults.crashloop FLAG LAUNCHES -- ARGS...``: every launch
appends a line to LAUNCHES; while FLAG exists the process exits at once (a
server that dies on start), otherwise it runs the testing server with ARGS.
"""

from __future__ import annotations

import os
import runpy
import sys

if __name__ == "__main__":
    flag, launches, *rest = sys.argv[1:]
    with open(launches, "a") as out:
        out.write("launch\n")
    if os.path.exists(flag):
        sys.exit(1)
    sys.argv = ["stopline.integrations.mcp.testing", *rest]
    runpy.run_module("stopline.integrations.mcp.testing", run_name="__main__")
