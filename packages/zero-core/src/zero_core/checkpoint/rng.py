"""Random number generator states as tensors and JSON (never pickled).

Exact resume needs every rank's generators back where they were: torch's CPU generator (a
uint8 tensor), the accelerator's (one per device), Python's ``random`` and NumPy's global
generator. Tensors go into the rank's safetensors file, the rest into its JSON.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:  # numpy ships with torch wheels, but is optional for torch itself
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

TORCH_CPU = "rng:torch_cpu"
NUMPY_KEYS = "rng:numpy_keys"
_CUDA = "rng:cuda:"


def capture() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {TORCH_CPU: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"{_CUDA}{i}"] = s
    version, internal, gauss = random.getstate()
    meta: dict[str, Any] = {"python": [version, list(internal), gauss]}
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        tensors[NUMPY_KEYS] = torch.from_numpy(keys.astype(np.int64))
        meta["numpy"] = [kind, int(pos), int(has_gauss), float(cached)]
    return tensors, meta


def restore(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    if TORCH_CPU in tensors:
        torch.set_rng_state(tensors[TORCH_CPU])
    cuda = sorted(k for k in tensors if k.startswith(_CUDA))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    if "python" in meta:
        version, internal, gauss = meta["python"]
        random.setstate((version, tuple(internal), gauss))
    if np is not None and "numpy" in meta and NUMPY_KEYS in tensors:
        kind, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((kind, tensors[NUMPY_KEYS].numpy().astype(np.uint32), pos, has_gauss, cached))
