"""A worker process run until it says a word, then SIGKILLed (a crash at a chosen point)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import anyio


async def run_until_then_kill(script: Path, source: str, word: bytes, *args: str) -> None:
    """Write ``source`` to ``script``, run it with ``args``, SIGKILL it once it prints
    ``word`` (its own barrier: the point it reached is in the ledger)."""
    await anyio.Path(script).write_text(source)
    async with await anyio.open_process([sys.executable, str(script), *args]) as proc:
        assert proc.stdout is not None
        async for chunk in proc.stdout:
            if word in chunk:
                break
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
