"""The CPU accelerator's DeepSpeed extras: supported_dtypes, random, the *Tensor types,
is_triton_supported."""

from __future__ import annotations

import pytest
import torch
from zero_core.accelerator.cpu import CpuAccelerator
from zero_core.accelerator.typed_tensors import TENSOR_TYPES


def test_supported_dtypes_random_and_triton():
    acc = CpuAccelerator()
    assert acc.supported_dtypes() == [torch.float32, torch.bfloat16, torch.float16]
    assert acc.random() is torch.random
    acc.random().manual_seed(3)
    a = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(a, torch.rand(2))
    assert acc.is_triton_supported() is False


@pytest.mark.parametrize("name", sorted(TENSOR_TYPES))
def test_tensor_types_are_torch_legacy_cpu_types(name):
    acc = CpuAccelerator()
    ctor = getattr(acc, name)
    assert ctor is getattr(torch, name)  # as DeepSpeed's CPU accelerator
    t = ctor([1, 2])
    assert t.dtype == TENSOR_TYPES[name] and t.device.type == "cpu" and t.tolist() == [1, 2]
    assert ctor(3).shape == (3,)
