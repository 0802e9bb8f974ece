"""``CudaAccelerator``: NVIDIA GPUs through ``torch.cuda`` (nccl).

Every method is a thin delegation to ``torch.cuda``; the value of this class is that the
rest of the project can be written (and tested on CPU) against ``Accelerator`` only.
Constructing it does not touch the CUDA driver, so importing this module is safe on CPU-only
machines; calling its methods there raises torch's own "no CUDA" errors.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from zero_core.accelerator._validate import check_index, check_rng_state, check_seed, check_tensor
from zero_core.accelerator.typed_tensors import TensorFactory, TypedTensorsMixin

if TYPE_CHECKING:
    from zero_core.protocols.accelerator import Stream


def _device_arg(index: int | None) -> torch.device | None:
    # torch.cuda functions take None as "the current device".
    return None if index is None else torch.device("cuda", index)


class CudaAccelerator(TypedTensorsMixin):
    """NVIDIA GPU accelerator (``torch.cuda``); the communication backend is nccl."""

    device_type = "cuda"

    def __repr__(self) -> str:
        return "CudaAccelerator()"

    # Stream/Event are exposed as class attributes like the CPU ones, resolved lazily so that
    # merely importing this module never requires CUDA.
    @property
    def Stream(self) -> type:  # noqa: N802 (mirrors torch.cuda.Stream)
        return torch.cuda.Stream

    @property
    def Event(self) -> type:  # noqa: N802 (mirrors torch.cuda.Event)
        return torch.cuda.Event

    # -- devices ---------------------------------------------------------------------------
    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_name(self, index: int | None = None) -> str:
        check_index(index, "CudaAccelerator.device_name")
        return "cuda" if index is None else f"cuda:{index}"

    def device(self, index: int | None = None) -> torch.device:
        check_index(index, "CudaAccelerator.device")
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def set_device(self, index: int) -> None:
        if index is None:
            raise ValueError("CudaAccelerator.set_device: index must be a non-negative int, got None")
        check_index(index, "CudaAccelerator.set_device")
        count = torch.cuda.device_count()
        if index >= count:
            raise ValueError(
                f"CudaAccelerator.set_device: index {index} out of range, {count} GPU(s) visible"
            )
        torch.cuda.set_device(index)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def communication_backend_name(self) -> str:
        return "nccl"

    # -- streams and events --------------------------------------------------------------
    def stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.StreamContext:
        return torch.cuda.stream(stream)

    def current_stream(self, index: int | None = None) -> torch.cuda.Stream:
        check_index(index, "CudaAccelerator.current_stream")
        return torch.cuda.current_stream(_device_arg(index))

    def default_stream(self, index: int | None = None) -> torch.cuda.Stream:
        check_index(index, "CudaAccelerator.default_stream")
        return torch.cuda.default_stream(_device_arg(index))

    def synchronize(self, index: int | None = None) -> None:
        check_index(index, "CudaAccelerator.synchronize")
        torch.cuda.synchronize(_device_arg(index))

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor``'s memory, so the block is
        not handed out again until the work queued on ``stream`` so far has finished (a tensor
        allocated on one stream and read on another; see [Note: stage-3 streams])."""
        check_tensor(tensor, "CudaAccelerator.record_stream")
        if tensor.device.type == "cuda":
            tensor.record_stream(stream)

    # -- memory --------------------------------------------------------------------------
    def memory_allocated(self, index: int | None = None) -> int:
        check_index(index, "CudaAccelerator.memory_allocated")
        return torch.cuda.memory_allocated(_device_arg(index))

    def max_memory_allocated(self, index: int | None = None) -> int:
        check_index(index, "CudaAccelerator.max_memory_allocated")
        return torch.cuda.max_memory_allocated(_device_arg(index))

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        check_index(index, "CudaAccelerator.reset_peak_memory_stats")
        torch.cuda.reset_peak_memory_stats(_device_arg(index))

    def memory_stats(self, index: int | None = None) -> dict[str, int]:
        check_index(index, "CudaAccelerator.memory_stats")
        return dict(torch.cuda.memory_stats(_device_arg(index)))

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    # -- pinned memory -------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        check_tensor(tensor, "CudaAccelerator.pin_memory")
        if tensor.device.type != "cpu":
            raise ValueError(
                f"CudaAccelerator.pin_memory: only CPU tensors can be pinned, got {tensor.device}"
            )
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        check_tensor(tensor, "CudaAccelerator.is_pinned")
        return tensor.device.type == "cpu" and tensor.is_pinned()

    # -- RNG -----------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        check_seed(seed, "CudaAccelerator.manual_seed")
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        check_seed(seed, "CudaAccelerator.manual_seed_all")
        torch.cuda.manual_seed_all(seed)

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        check_index(index, "CudaAccelerator.get_rng_state")
        return torch.cuda.get_rng_state("cuda" if index is None else index)

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        check_index(index, "CudaAccelerator.set_rng_state")
        check_rng_state(state, "CudaAccelerator.set_rng_state")
        torch.cuda.set_rng_state(state, "cuda" if index is None else index)

    # -- dtypes --------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return torch.cuda.is_available()

    def _typed_tensor(self, dtype: torch.dtype) -> TensorFactory:
        # as DeepSpeed's CUDA accelerator: torch.tensor with the dtype and the device fixed
        return functools.partial(torch.tensor, dtype=dtype, device="cuda")

    def is_triton_supported(self) -> bool:
        """Triton kernels need compute capability 8.0 or newer (DeepSpeed's rule)."""
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
