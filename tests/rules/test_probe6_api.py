"""Probe 6 of the public API from outside: a tool named by what it wraps.

A tool made of a ``functools.partial`` or a callable object, with no ``name=``, was
named "tool": two such tools were one name, their receipt lines "tool" and "tool",
which call did what not to be told from the receipt. A tool takes its name from the
function inside its partials, or from a callable object's class.
"""

from __future__ import annotations

import functools

import pytest

import stopline
from stopline import OpStatus

pytestmark = pytest.mark.timeout(30)


async def send_email(to: str, body: str) -> str:
    return f"email to {to}: {body}"


async def send_sms(to: str, body: str) -> str:
    return f"sms to {to}: {body}"


class Pager:
    """A callable object as a tool (a client holding its own settings)."""

    async def __call__(self, body: str) -> str:
        return f"paged: {body}"


def test_a_partial_is_named_by_its_function_and_a_callable_object_by_its_class() -> None:
    twice = functools.partial(functools.partial(send_email, "ana"), body="hi")
    assert stopline.Tool(functools.partial(send_email, "ana")).name == "send_email"
    assert stopline.Tool(twice).name == "send_email"
    assert stopline.Tool(Pager()).name == "Pager"
    assert stopline.Tool(Pager(), name="pager").name == "pager"  # a name given wins


async def test_two_partials_of_two_tools_are_two_lines_of_the_receipt(
    ledger: stopline.Ledger,
) -> None:
    email = stopline.Tool(functools.partial(send_email, "ana"))
    sms = stopline.Tool(functools.partial(send_sms, "ana"))
    async with ledger.run("notify", owner="user:ana") as run:
        assert await run.call(email, "hi") == "email to ana: hi"
        assert await run.call(sms, "hi") == "sms to ana: hi"
    ops = await ledger.backend.operations(run.id)
    assert [(op.tool, op.status) for op in ops] == [
        ("send_email", OpStatus.COMMITTED),
        ("send_sms", OpStatus.COMMITTED),
    ]
    lines = (await ledger.receipt(run.id)).text()
    assert "send email: completed" in lines and "send sms: completed" in lines
