"""``zero.OnDevice``: construct a model's tensors directly on a device (``"meta"``) and dtype.

DeepSpeed's ``deepspeed.OnDevice(dtype, device="meta", enabled=True)`` is a context manager
inside which model construction allocates on ``device`` with floating-point tensors in
``dtype``. On ``"meta"`` nothing is allocated at all: a model of any size can be built to
inspect its structure or count parameters, then materialized with ``module.to_empty(device=...)``
and loaded. It is built from PyTorch's device context (``with torch.device(...)``) and default
dtype, which tensor factories and ``nn.Module`` constructors follow; integer tensors keep
their dtype. Both are restored on exit, also when construction raises.
"""

from __future__ import annotations

import torch

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class OnDevice:
    """Create tensors on ``device`` (default ``"meta"``) with floating dtype ``dtype`` inside the context."""

    def __init__(
        self, dtype: torch.dtype | None, device: torch.device | str | int = "meta", enabled: bool = True
    ) -> None:
        if dtype is not None and dtype not in _FLOATING:
            raise ValueError(f"OnDevice: dtype must be a floating-point torch dtype or None, got {dtype!r}")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"OnDevice: device {device!r} is not a torch device") from exc
        self.dtype = dtype
        self.enabled = bool(enabled)
        self._device_ctx: torch.device | None = None
        self._saved_dtype: torch.dtype | None = None

    def __enter__(self) -> OnDevice:
        if not self.enabled:
            return self
        self._device_ctx = torch.device(self.device)
        self._device_ctx.__enter__()
        if self.dtype is not None:
            self._saved_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self._saved_dtype is not None:
            torch.set_default_dtype(self._saved_dtype)
            self._saved_dtype = None
        self._device_ctx.__exit__(*exc)
        self._device_ctx = None
