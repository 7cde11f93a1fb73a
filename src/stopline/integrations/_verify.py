"""Verifiers of the framework adapters: the one signature, and what a server's answer proves.

Every read-back stopline runs is a ``Verifier``, ``async (ctx: CallContext) ->
ReadBack | Verdict`` (``stopline.runtime.tool``; docs/decisions/0032). The
adapters' ``verify=`` took the key alone before 0.2 (``VerifyByKey``); that form
is read for one release, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Awaitable, Callable
from typing import Any, cast

from stopline.runtime.context import CallContext
from stopline.runtime.tool import ReadBack, Verdict, Verifier

__all__ = ["VerifyByKey", "as_verifier", "verify_answer", "wants_context"]


# Deprecated (0.2, removed in 0.3): a verifier taking the key alone. Pass the one
# verifier signature, ``Verifier``: ``async def verify(ctx: CallContext)``, reading ``ctx.key``.
VerifyByKey = Callable[[str], Awaitable["ReadBack | Verdict"]]


def as_verifier(fn: Verifier | VerifyByKey | None) -> Verifier | None:
    """An adapter's ``verify=`` in the one verifier signature (``Verifier``).

    A function whose first parameter is named ``ctx`` or annotated ``CallContext``
    is a ``Verifier`` already. Any other is read as the earlier ``verify(key)``
    form: accepted for one release (0.2), with a ``DeprecationWarning``.
    """
    if fn is None or wants_context(fn):
        return cast("Verifier | None", fn)
    by_key = cast(VerifyByKey, fn)
    warnings.warn(
        f"a verifier taking the key ({getattr(fn, '__qualname__', fn)!r}) is deprecated "
        "and goes in 0.3: take the call's context, async def verify(ctx: CallContext), "
        "and read ctx.key",
        DeprecationWarning,
        stacklevel=3,
    )

    async def read_back(ctx: CallContext) -> ReadBack | Verdict:
        return await by_key(ctx.key)

    return read_back


def verify_answer(status: Any, server: str, key: str) -> ReadBack:
    """What a server's ``stopline_verify`` answer for ``key`` proves; anything but
    its status record proves nothing."""
    from stopline.integrations.mcp import VERIFY_TOOL

    if not isinstance(status, dict):
        return ReadBack(Verdict.UNKNOWN, detail=f"{VERIFY_TOOL}: {status!r}")
    ref = f"{VERIFY_TOOL}:{server}:{key}"
    return ReadBack(Verdict(status.get("verdict", "unknown")), ref, str(status.get("detail", "")))


def wants_context(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes the call's context first (named ``ctx`` or annotated)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and (params[0].name == "ctx" or "CallContext" in str(params[0].annotation))
