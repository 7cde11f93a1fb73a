"""What a Pydantic AI tool's own exceptions say of the call the gate recorded.

An exception out of a gated call leaves it ``unknown`` (R3: it may have happened),
unless it is ``Rejected``. Pydantic AI gives a tool three ways to say it did nothing:

- ``raise ModelRetry(...) from stopline.Rejected(...)``: it refused before any effect,
  and the model is asked again (a ``ModelRetry`` alone proves nothing: ``unknown``);
- ``raise ApprovalRequired()``: it will not run before a person approves this call (a
  tool that decides per call, where ``requires_approval`` decides per tool);
- ``raise CallDeferred()``: it is not run in this agent run; whoever runs it elsewhere
  hands its result back (``DeferredToolResults.calls``).

Recorded ``unknown``, the last two made the run's receipt say "may have happened;
verifying" of a call that never ran, and the approved call, run again under the same
key, met its own record in doubt at the gate: it was never sent (ADR 0121). Each is
recorded ``not_committed`` (``Refused``: a ``Rejected`` carrying Pydantic AI's
exception), and Pydantic AI gets its own exception back (``StoplineToolset.call_tool``
raises ``Refused.then``), so it asks the model again, or ends the run with
``DeferredToolRequests``, as without stopline.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelRetry

from stopline.runtime.tool import Rejected

__all__ = ["Refused", "said_nothing_done"]

_DEFERRED = {
    ApprovalRequired: "not run: the tool asked for approval first (ApprovalRequired)",
    CallDeferred: "not run here: the tool deferred it to be run elsewhere (CallDeferred)",
}


class Refused(Rejected):
    """The tool said it did nothing (recorded ``not_committed``); ``then`` is the
    exception Pydantic AI is handed, as the tool raised it."""

    def __init__(self, then: Exception, reason: str, ref: str = "") -> None:
        super().__init__(reason, ref=ref)
        self.then = then


async def said_nothing_done(call: Callable[[], Awaitable[Any]]) -> Any:
    """``call()``, the tool's own call; an exception by which it says it did nothing
    becomes ``Refused``."""
    try:
        return await call()
    except ModelRetry as retry:
        if isinstance(cause := retry.__cause__, Rejected):  # the tool says: nothing done
            raise Refused(retry, cause.reason, cause.ref) from retry
        raise  # a retry alone proves nothing: unknown, then verified
    except (ApprovalRequired, CallDeferred) as deferred:
        raise Refused(deferred, _DEFERRED[type(deferred)]) from deferred
