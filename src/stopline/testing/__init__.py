"""Test your own agent's cancellation: barriers, fault-injecting providers, the explorer.

``await explore(workflow, providers)`` runs every (point x action) cell and
checks the contract after each; see docs/testing.md.
"""

from stopline.testing.actions import CORE_ACTIONS, DEFAULT_ACTIONS
from stopline.testing.barriers import Barrier, Barriers
from stopline.testing.explorer import explore
from stopline.testing.matrix import Cell, CellStatus, ExplorationFailed, Matrix
from stopline.testing.providers import CancelBehaviour, FakeProvider

__all__ = [
    "CORE_ACTIONS",
    "DEFAULT_ACTIONS",
    "Barrier",
    "Barriers",
    "CancelBehaviour",
    "Cell",
    "CellStatus",
    "ExplorationFailed",
    "FakeProvider",
    "Matrix",
    "explore",
]
