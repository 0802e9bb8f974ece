"""``zero.utils.set_random_seed``: seed every random number generator a training script uses.

DeepSpeed's ``deepspeed.runtime.utils.set_random_seed`` and transformers' ``set_seed`` seed
Python's ``random``, NumPy (when installed) and torch; torch's seed covers the CPU generator
and the generators of every accelerator device. We also seed the current accelerator through
the accelerator abstraction (its ``manual_seed_all``), so a non-CUDA accelerator is seeded too.
"""

from __future__ import annotations

import random


def set_random_seed(seed: int) -> None:
    """Seed ``random``, NumPy (if installed), torch and the accelerator with ``seed``."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"set_random_seed: seed must be an int, got {seed!r}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"set_random_seed: seed must be in [0, 2**32) (NumPy's range), got {seed}")
    import torch

    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)
    from zero_core.accelerator import get_accelerator

    acc = get_accelerator()
    seed_all = getattr(acc, "manual_seed_all", None)
    if seed_all is not None:
        seed_all(seed)
