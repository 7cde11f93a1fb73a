"""One verifier signature: ``async (ctx: CallContext) -> ReadBack | Verdict`` (ADR 0032).

The adapters' ``verify=`` took the key alone before 0.2; that form is read for
one release, with a ``DeprecationWarning``, by ``as_verifier``.
"""

from __future__ import annotations

import types
import warnings
from typing import cast

import pytest

import stopline
from stopline import ReadBack, Verdict
from stopline.integrations._frameworks import as_verifier


def _ctx(key: str) -> stopline.CallContext:
    return cast(stopline.CallContext, types.SimpleNamespace(key=key))


async def test_a_verifier_taking_the_context_is_used_as_it_is() -> None:
    async def verify(ctx: stopline.CallContext) -> ReadBack:
        return ReadBack(Verdict.COMMITTED, ctx.key)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert as_verifier(verify) is verify
        assert as_verifier(None) is None


async def test_a_verifier_taking_the_key_is_read_with_a_deprecation_warning() -> None:
    seen: list[str] = []

    async def by_key(key: str) -> Verdict:
        seen.append(key)
        return Verdict.NOT_COMMITTED

    with pytest.warns(DeprecationWarning, match="by_key.*deprecated.*ctx.key"):
        verifier = as_verifier(by_key)
    assert verifier is not None
    assert await verifier(_ctx("run_1/tool:9")) is Verdict.NOT_COMMITTED
    assert seen == ["run_1/tool:9"]


def test_the_one_signature_is_public_and_shared() -> None:
    from stopline.runtime import tool

    assert stopline.Verifier is tool.Verifier
    assert tool.VerifyFn is tool.Verifier  # the earlier name, an alias until 0.3
