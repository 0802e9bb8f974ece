"""The builder for the config's ``optimizer`` section (config type name -> a torch optimizer).

The optimizers zero adds to torch's (FusedAdam without bias correction, LAMB, CPU Adam, Lion, the
1-bit family) are implementations, so they live in zero-ops; the builder finds them through
``zero_core.plugins.require``, which names zero-ops when it is missing.
"""

from zero_core.optim.builder import OPTIMIZER_TYPES, build_optimizer

__all__ = ["OPTIMIZER_TYPES", "build_optimizer"]
