"""Listed schemas a client cannot use, from a real stdio server on the SDK's low-level
``Server`` (``tests/mcp/invalid_schema_server.py``), ADR 0122.

An ``inputSchema`` no validator can use: the call is gated, recorded and sent
unchecked (the server judges its arguments), the log says so once per listed schema,
and a sound schema on the same connection is still checked.

Before ADR 0122 an invalid schema already checked nothing, but a valid one whose use
fails (a ``$ref`` that resolves nowhere, a schema that refers to itself whole) raised
the validator's own error from the call (``RecursionError``, jsonschema's
``_WrappedReferencingError``): no stopline error, nothing recorded or sent.

An answer the SDK refuses against the tool's ``outputSchema`` (after the tool ran) is
``NoAnswer`` (``server_error``), ``unknown``, and the connection lives. Before, it was
``transport`` and the connection was dropped: the server process was closed under
every other call in flight on it (a call that would have committed never ran)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from mcp import StdioServerParameters
from stopline import Cause, OpStatus
from stopline.integrations.mcp import StoplineMCP, ToolPolicy

SERVER = Path(__file__).resolve().parent / "invalid_schema_server.py"
UNUSABLE = ["stamp", "letters", "itself", "nowhere", "elsewhere"]
LOGGER = "stopline.integrations.mcp._tools"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def ran(log: Path) -> list[dict[str, Any]]:
    """What the server's tools ran, in order (its ground truth)."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


async def test_a_schema_no_validator_can_use_checks_nothing_and_the_call_is_gated_and_sent(
    ledger: stopline.Ledger, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "ran.jsonl"
    target = StdioServerParameters(command=sys.executable, args=[str(SERVER), str(log)])
    caplog.set_level(logging.WARNING, logger=LOGGER)
    misfit = {"n": "not a number", "word": "42"}
    async with (
        StoplineMCP(target, name="odd") as conn,
        ledger.run("odd", owner="user:1", run_id="unusable") as run,
    ):
        for name in UNUSABLE:
            assert await conn.call(run, name, misfit, key=name) == {"stamped": name}
        again = await conn.call(run, "itself", {"n": 1}, key="itself-again")
        # the sound schema on the same connection is still checked: refused, not sent
        with pytest.raises(stopline.InvalidInput, match="n: 'not a number' is not of type"):
            await conn.call(run, "count", misfit, key="count")
    assert again == {"stamped": "itself"}
    ops = await ledger.backend.operations("unusable")
    assert [(op.id, op.status, op.evidence[0].ref) for op in ops] == [
        *((f"unusable/{name}", OpStatus.COMMITTED, "gate") for name in UNUSABLE),
        ("unusable/itself-again", OpStatus.COMMITTED, "gate"),
    ]
    # each call the gate passed reached the server's tool, as sent, with its key
    assert [(e["tool"], e["arguments"], e["key"]) for e in ran(log)] == [
        *((name, misfit, f"unusable/{name}") for name in UNUSABLE),
        ("itself", {"n": 1}, "unusable/itself-again"),
    ]
    # said once per listed schema, naming the server, the tool and why
    words = said(caplog)
    assert len(words) == len(UNUSABLE)
    for name, line in zip(UNUSABLE, words, strict=True):
        assert f"MCP server 'odd' lists tool {name!r} with an inputSchema no validator" in line
        assert "gated and sent unchecked" in line
    assert "RecursionError" in words[2]
    assert "/$defs/missing" in words[3]
    assert "http://127.0.0.1:9/n.json" in words[4]


async def test_with_the_check_off_nothing_is_validated_or_said(
    ledger: stopline.Ledger, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "ran.jsonl"
    target = StdioServerParameters(command=sys.executable, args=[str(SERVER), str(log)])
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with (
        StoplineMCP(target, name="odd", check_input_schemas=False) as conn,
        ledger.run("odd", owner="user:1", run_id="off") as run,
    ):
        for name in [*UNUSABLE, "count"]:
            assert await conn.call(run, name, {"n": "x"}, key=name) == {"stamped": name}
    assert [e["tool"] for e in ran(log)] == [*UNUSABLE, "count"]
    assert said(caplog) == []


async def test_an_answer_that_misfits_its_output_schema_is_a_server_error_on_a_live_connection(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """Three answers the SDK refuses after the tool ran (a misfit, no structured content,
    an ``outputSchema`` that refers to itself whole), while another call is in flight on
    the same connection: each is ``unknown`` (``server_error``); the call in flight is
    answered and committed, on the one connection."""
    log, pipe = tmp_path / "ran.jsonl", tmp_path / "slow.pipe"
    os.mkfifo(pipe)
    target = StdioServerParameters(command=sys.executable, args=[str(SERVER), str(log)])
    refused: dict[str, stopline.NoAnswer] = {}
    async with (
        StoplineMCP(target, name="odd") as conn,
        ledger.run("odd", owner="user:1", run_id="misfits") as run,
    ):
        slow: list[Any] = []

        async def in_flight() -> None:
            slow.append(await conn.call(run, "slow", {"pipe": str(pipe)}, key="slow"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(in_flight)
            fd = await anyio.to_thread.run_sync(os.open, str(pipe), os.O_WRONLY)
            for name in ("misfit", "bare", "loop_out"):  # while ``slow`` is in flight
                with pytest.raises(stopline.NoAnswer, match="malformed result") as caught:
                    await conn.call(run, name, {}, key=name)
                refused[name] = caught.value
            os.close(fd)  # ``slow`` reads its pipe to the end and answers
        assert conn.connections == 1
    assert slow == [{"stamped": "slow"}]
    assert {name: e.cause for name, e in refused.items()} == dict.fromkeys(
        refused, Cause.SERVER_ERROR
    )
    assert "'x' is not of type 'integer'" in refused["misfit"].detail
    assert "did not return structured content" in refused["bare"].detail
    assert "RecursionError" in refused["loop_out"].detail
    # unknown, and with nothing to read them back, a reviewer's (each ran: the log says so)
    await ledger.wait_settled("misfits", timeout=20)
    ops = {op.id: (op.status, op.cause) for op in await ledger.backend.operations("misfits")}
    assert ops == {
        "misfits/misfit": (OpStatus.NEEDS_REVIEW, Cause.SERVER_ERROR),
        "misfits/bare": (OpStatus.NEEDS_REVIEW, Cause.SERVER_ERROR),
        "misfits/loop_out": (OpStatus.NEEDS_REVIEW, Cause.SERVER_ERROR),
        "misfits/slow": (OpStatus.COMMITTED, None),
    }
    assert [e["tool"] for e in ran(log)] == ["misfit", "bare", "loop_out", "slow"]


async def test_a_read_whose_answer_misfits_its_output_schema_is_a_typed_error(
    ledger: stopline.Ledger, tmp_path: Path
) -> None:
    """A declared read: ``NoAnswer`` (``server_error``), nothing recorded; before, the
    SDK's ``RuntimeError`` reached the caller as it was."""
    target = StdioServerParameters(command=sys.executable, args=[str(SERVER), str(tmp_path / "l")])
    policies = {"misfit": ToolPolicy(effects=False)}
    async with (
        StoplineMCP(target, name="odd", policies=policies) as conn,
        ledger.run("odd", owner="user:1", run_id="read") as run,
    ):
        with pytest.raises(stopline.NoAnswer, match="malformed result") as caught:
            await conn.call(run, "misfit", {})
        assert await conn.call(run, "stamp", {}, key="after") == {"stamped": "stamp"}
        assert conn.connections == 1
    assert caught.value.cause is Cause.SERVER_ERROR
    assert [op.id for op in await ledger.backend.operations("read")] == ["read/after"]
