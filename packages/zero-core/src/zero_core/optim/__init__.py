"""Optimizers zero-core provides itself (torch has no LAMB, and its Adam always bias-corrects)
and the builder for the config's ``optimizer`` section."""

from zero_core.optim.adam import FusedAdam
from zero_core.optim.builder import OPTIMIZER_TYPES, build_optimizer
from zero_core.optim.lamb import Lamb
from zero_core.optim.onebit import OnebitAdam, OnebitLamb, ZeroOneAdam

__all__ = [
    "FusedAdam",
    "Lamb",
    "OnebitAdam",
    "OnebitLamb",
    "ZeroOneAdam",
    "build_optimizer",
    "OPTIMIZER_TYPES",
]
