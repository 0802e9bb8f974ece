"""The parts of DeepSpeed's accelerator interface that scripts and libraries call beyond
devices, streams, memory and RNG: ``supported_dtypes()``, ``random()``, ``is_triton_supported()``
and the ``*Tensor`` constructors (``get_accelerator().FloatTensor(...)``).

As in DeepSpeed, the CPU accelerator's ``*Tensor`` are torch's legacy CPU tensor types
(``torch.FloatTensor``: ``FloatTensor(3)`` is an uninitialised tensor of 3 elements,
``FloatTensor([1.0])`` holds the data) and CUDA's are ``torch.tensor`` with the dtype and device
fixed (``FloatTensor([1.0])`` on the GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

#: what ``FloatTensor`` & co. are: a callable making a tensor of one dtype (torch's legacy type on CPU)
TensorFactory = Callable[..., torch.Tensor]

#: DeepSpeed's property names -> dtype
TENSOR_TYPES = {
    "BFloat16Tensor": torch.bfloat16,
    "ByteTensor": torch.uint8,
    "DoubleTensor": torch.float64,
    "FloatTensor": torch.float32,
    "HalfTensor": torch.float16,
    "IntTensor": torch.int32,
    "LongTensor": torch.int64,
}

#: dtype -> torch's legacy CPU tensor type (``torch.FloatTensor`` ...)
LEGACY_CPU_TYPES = {dtype: getattr(torch, name) for name, dtype in TENSOR_TYPES.items()}


class TypedTensorsMixin:
    """Adds DeepSpeed's dtype helpers to an accelerator; subclasses define ``_typed_tensor``."""

    def _typed_tensor(self, dtype: torch.dtype) -> TensorFactory:
        raise NotImplementedError

    def is_bf16_supported(self) -> bool:
        raise NotImplementedError

    def is_fp16_supported(self) -> bool:
        raise NotImplementedError

    def supported_dtypes(self) -> list[torch.dtype]:
        """The floating dtypes training can use on this device (fp32 first, as DeepSpeed lists them)."""
        out = [torch.float32]
        if self.is_fp16_supported():
            out.append(torch.float16)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        return out

    def random(self) -> ModuleType:
        """torch's RNG module (``get_accelerator().random().manual_seed(...)``), as DeepSpeed's."""
        return torch.random

    def is_triton_supported(self) -> bool:
        return False

    @property
    def BFloat16Tensor(self) -> TensorFactory:  # noqa: N802 (DeepSpeed's names)
        return self._typed_tensor(torch.bfloat16)

    @property
    def ByteTensor(self) -> TensorFactory:  # noqa: N802
        return self._typed_tensor(torch.uint8)

    @property
    def DoubleTensor(self) -> TensorFactory:  # noqa: N802
        return self._typed_tensor(torch.float64)

    @property
    def FloatTensor(self) -> TensorFactory:  # noqa: N802
        return self._typed_tensor(torch.float32)

    @property
    def HalfTensor(self) -> TensorFactory:  # noqa: N802
        return self._typed_tensor(torch.float16)

    @property
    def IntTensor(self) -> TensorFactory:  # noqa: N802
        return self._typed_tensor(torch.int32)

    @property
    def LongTensor(self) -> TensorFactory:  # noqa: N802
        return self._typed_tensor(torch.int64)
