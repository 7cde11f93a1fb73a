"""Keywords renamed in 0.2: the old name keeps working for one release, with a warning.

``timeout`` meant two things: a deadline for the whole call in ``run.call``
and the silence allowed between signs of life in ``StoplineMCP.call`` and
the framework adapters' MCP tools (ADR 0030). The silence is now
``idle_timeout``; ``timeout`` is always the call's deadline. Passing
``timeout=`` where it meant the silence still means the silence in 0.2, with
a ``DeprecationWarning``; in 0.3 ``timeout=`` there becomes the call's
deadline, as in ``run.call``.
"""

from __future__ import annotations

import warnings

from stopline.domain.limits import check_seconds

__all__ = ["renamed_idle_timeout"]


def renamed_idle_timeout(where: str, idle: float | None, timeout: float | None) -> float | None:
    """The silence allowed: ``idle_timeout=``, or the deprecated ``timeout=`` of ``where``;
    a number of seconds, 0 or more, or ``InvalidInput`` naming it (before the gate)."""
    if timeout is None:
        return check_seconds("idle_timeout", idle)
    if idle is not None:
        raise TypeError(f"{where}: pass idle_timeout= only (timeout= is its deprecated name)")
    warnings.warn(
        f"{where}(timeout=) is the silence allowed between signs of life, renamed "
        "idle_timeout= (ADR 0030); in 0.3 timeout= becomes the call's deadline, as in run.call",
        DeprecationWarning,
        stacklevel=3,
    )
    return check_seconds("timeout", timeout)
