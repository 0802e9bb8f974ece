"""Selecting the accelerator: ``get_accelerator()`` / ``set_accelerator(acc)``.

The choice is made once per process and cached: CUDA when ``torch.cuda.is_available()``,
else CPU; the environment variable ``ZERO_ACCELERATOR`` (``cpu`` or ``cuda``) overrides the
detection (the counterpart of DeepSpeed's ``DS_ACCELERATOR``).
"""

from __future__ import annotations

import os
import threading

import torch

from zero_core.accelerator.cpu import CpuAccelerator, CpuEvent, CpuStream
from zero_core.accelerator.cuda import CudaAccelerator
from zero_core.protocols.accelerator import Accelerator

ENV_VAR = "ZERO_ACCELERATOR"
_CHOICES = ("cpu", "cuda")

_lock = threading.Lock()
_accelerator: Accelerator | None = None


def _detect() -> Accelerator:
    requested = os.environ.get(ENV_VAR, "").strip().lower()
    if requested and requested not in _CHOICES:
        raise ValueError(
            f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not a known accelerator; allowed: {', '.join(_CHOICES)}"
        )
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"{ENV_VAR}=cuda but torch.cuda.is_available() is False (no GPU or a CPU-only torch)"
            )
        return CudaAccelerator()
    if requested == "cpu":
        return CpuAccelerator()
    return CudaAccelerator() if torch.cuda.is_available() else CpuAccelerator()


def get_accelerator() -> Accelerator:
    """The process-wide accelerator (detected on first call, then cached)."""
    global _accelerator
    if _accelerator is None:
        with _lock:
            if _accelerator is None:
                _accelerator = _detect()
    return _accelerator


def set_accelerator(accelerator: Accelerator | None) -> None:
    """Replace the process-wide accelerator; ``None`` clears the cache so the next
    ``get_accelerator()`` detects again (useful in tests after changing ``ZERO_ACCELERATOR``)."""
    global _accelerator
    if accelerator is not None and not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"set_accelerator: {type(accelerator).__name__} does not implement the Accelerator protocol "
            "(zero_core.protocols.Accelerator)"
        )
    with _lock:
        _accelerator = accelerator


__all__ = [
    "CpuAccelerator",
    "CpuEvent",
    "CpuStream",
    "CudaAccelerator",
    "get_accelerator",
    "set_accelerator",
]
