"""Tools for testing your own agent's cancellation: barriers and fault-injecting providers."""

from stopline.testing.barriers import Barrier, Barriers
from stopline.testing.providers import CancelBehaviour, FakeProvider

__all__ = ["Barrier", "Barriers", "CancelBehaviour", "FakeProvider"]
