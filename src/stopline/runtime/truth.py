"""Truth after the fact: reconciliation, compensation, the review queue, crash recovery.

``TruthMixin`` gives ``Ledger`` its methods for closing the loop on what
passed the gate (CONTRACT.md R2, R3, R5, R8, R12).
"""

from __future__ import annotations

__all__ = ["TruthMixin"]


class TruthMixin:
    """Methods of ``Ledger`` about what happened after dispatch."""
