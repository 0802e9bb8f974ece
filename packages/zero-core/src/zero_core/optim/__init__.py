"""Optimizers zero-core provides itself (torch has no LAMB) and the builder for the config's
``optimizer`` section."""

from zero_core.optim.builder import OPTIMIZER_TYPES, build_optimizer
from zero_core.optim.lamb import Lamb

__all__ = ["Lamb", "build_optimizer", "OPTIMIZER_TYPES"]
