"""Lifecycle: child runs and ownership, pause and resume, approvals, authority.

``LifecycleMixin`` gives ``Ledger`` its methods for trees of runs and for
stopping without cancelling (CONTRACT.md R1, R6, R7, R9, R10, R11).
"""

from __future__ import annotations

__all__ = ["LifecycleMixin"]


class LifecycleMixin:
    """Methods of ``Ledger`` about the shape and the pauses of runs."""
