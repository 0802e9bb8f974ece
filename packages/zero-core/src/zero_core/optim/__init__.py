"""Optimizers zero-core provides itself (torch has no LAMB, and its Adam always bias-corrects)
and the builder for the config's ``optimizer`` section."""

from zero_core.optim.adam import FusedAdam
from zero_core.optim.builder import OPTIMIZER_TYPES, build_optimizer
from zero_core.optim.lamb import Lamb

__all__ = ["FusedAdam", "Lamb", "build_optimizer", "OPTIMIZER_TYPES"]
