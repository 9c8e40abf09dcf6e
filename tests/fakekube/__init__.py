"""An in-process fake Kubernetes API server speaking the real REST list/watch protocol, for tests."""

from .server import FakeKube

__all__ = ["FakeKube"]
