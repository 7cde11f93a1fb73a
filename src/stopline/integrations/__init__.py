"""Integrations: stopline's contract carried over other protocols and frameworks.

``stopline.integrations.mcp`` makes Model Context Protocol tool calls truthful
from both ends (it needs the ``mcp`` extra: ``pip install 'stopline[mcp]'``).
"""
