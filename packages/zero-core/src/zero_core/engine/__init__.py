"""The training engine and ``initialize``."""

from zero_core.engine.engine import ZeroEngine
from zero_core.engine.initialize import initialize

__all__ = ["ZeroEngine", "initialize"]
