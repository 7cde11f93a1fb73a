"""Run a worker in a child process, read what it says, kill it: the crash tests' tools."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
from anyio.streams.text import TextReceiveStream

ROOT = Path(__file__).resolve().parents[2]


class Child:
    """A worker process; ``expect(prefix)`` is the barrier on what it prints."""

    def __init__(self, proc: anyio.abc.Process) -> None:
        self.proc = proc
        assert proc.stdout is not None
        self._lines = _lines(TextReceiveStream(proc.stdout))

    async def expect(self, prefix: str) -> str:
        async for line in self._lines:
            if line.startswith(prefix):
                return line
        raise EOFError(f"the worker exited before saying {prefix!r}")

    async def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no cleanup, no retire, no outcome
        await self.proc.wait()
        await self.proc.aclose()


async def _lines(stream: TextReceiveStream) -> AsyncIterator[str]:
    pending = ""
    async for chunk in stream:
        pending += chunk
        *done, pending = pending.split("\n")
        for line in done:
            yield line.strip()


async def start(module: str, *args: str) -> Child:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    proc = await anyio.open_process(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, stderr=None
    )
    return Child(proc)
