"""How a checkpoint keeps its tensor inputs between forward and recompute.

[Note: saved-input storage]
A checkpoint keeps only its inputs. Three options change how (all from the config section):

* ``partition_activations`` (needs an mpu whose model-parallel world size is > 1): every rank keeps
  ``1/world`` of each flattened input (padded to a multiple of the world size) and the recompute
  all-gathers the full tensor over the model-parallel group. Model-parallel ranks hold identical
  activations, so nothing is lost, and each rank stores a fraction.
* ``cpu_checkpointing``: the kept tensor (a partition or the whole input) is copied to host memory and
  moved back to the input's device on recompute. On a CPU-only machine this is still a separate host copy,
  so the caller may reuse or free its input buffer.
* ``contiguous_memory_optimization``: the kept tensors are copied into one preallocated buffer per input
  position with ``number_checkpoints`` slots, which avoids fragmentation when many checkpoints are alive.
  It needs homogeneous checkpoints (same number, shapes and dtypes of inputs); the slots are recycled
  once every live checkpoint has run its backward, or by ``reset()``.
Without any option the inputs are kept by reference through ``ctx.save_for_backward`` (in checkpointing.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zero_core.activation_checkpointing.config import ActivationCheckpointingConfig

if TYPE_CHECKING:
    from zero_core.protocols.training import ModelParallelUnit


@dataclasses.dataclass
class SavedTensor:
    """One stored input: the kept data and what is needed to rebuild the full tensor."""

    data: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    partitioned: bool


def _all_gather_flat(output: torch.Tensor, part: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Gather equal flat partitions into ``output`` through the project's comm layer (the contract of
    docs/architecture.md); plain torch.distributed while that layer is not importable."""
    try:
        from zero_core import comm
    except ImportError:  # zero_core.comm not available in this installation
        comm = None
    gather = getattr(comm, "all_gather_into_tensor", None)
    if gather is None:
        dist.all_gather_into_tensor(output, part, group=group)
    else:
        gather(output, part, group=group)


class ContiguousBuffers:
    """Preallocated slot buffers for ``contiguous_memory_optimization``. See [Note: saved-input storage]."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next_slot = 0
        self._live = 0

    def store(self, parts: list[torch.Tensor], num_slots: int) -> list[torch.Tensor]:
        """Copy ``parts`` (one checkpoint's kept tensors) into the next slot; return the slot views."""
        if not self._buffers:
            self._buffers = [
                torch.empty((num_slots, p.numel()), dtype=p.dtype, device=p.device) for p in parts
            ]
        layout = [(b.shape[1], b.dtype, b.device) for b in self._buffers]
        got = [(p.numel(), p.dtype, p.device) for p in parts]
        if layout != got:
            raise ValueError(
                "activation checkpointing: contiguous_memory_optimization needs homogeneous checkpoints; "
                f"this one keeps (numel, dtype, device) {got}, the buffers were built for {layout}"
            )
        if self._next_slot >= num_slots:
            raise RuntimeError(
                f"activation checkpointing: more than number_checkpoints={num_slots} checkpoints are alive; "
                "raise number_checkpoints, or call reset() after forward passes that run no backward"
            )
        views = []
        for buffer, part in zip(self._buffers, parts):
            view = buffer[self._next_slot]
            view.copy_(part.reshape(-1))
            views.append(view)
        self._next_slot += 1
        self._live += 1
        return views

    def release(self) -> None:
        """One checkpoint finished its backward; recycle all slots when none is alive."""
        self._live = max(0, self._live - 1)
        if self._live == 0:
            self._next_slot = 0


def uses_storage(config: ActivationCheckpointingConfig, mpu: ModelParallelUnit | None) -> bool:
    """Whether any option changes how inputs are kept (else they are kept by reference)."""
    partition = config.partition_activations and mpu is not None and mpu.get_model_parallel_world_size() > 1
    return partition or config.cpu_checkpointing or config.contiguous_memory_optimization


def save_inputs(
    tensors: list[torch.Tensor],
    config: ActivationCheckpointingConfig,
    mpu: ModelParallelUnit | None,
    buffers: ContiguousBuffers,
) -> list[SavedTensor]:
    """Keep ``tensors`` as the options say. See [Note: saved-input storage]."""
    world = mpu.get_model_parallel_world_size() if (mpu is not None and config.partition_activations) else 1
    rank = mpu.get_model_parallel_rank() if world > 1 else 0
    saved = []
    for t in tensors:
        data, partitioned = t.detach(), False
        if world > 1:
            chunk = math.ceil(t.numel() / world)
            flat = data.reshape(-1)
            start, stop = rank * chunk, min((rank + 1) * chunk, t.numel())
            data = torch.zeros(chunk, dtype=t.dtype, device=t.device)
            if stop > start:
                data[: stop - start].copy_(flat[start:stop])
            partitioned = True
        if config.cpu_checkpointing:
            data = data.to("cpu", copy=True)
        saved.append(SavedTensor(data, t.shape, t.dtype, t.device, partitioned))
    if config.contiguous_memory_optimization and saved:
        views = buffers.store([s.data for s in saved], config.number_checkpoints)
        for s, view in zip(saved, views):
            s.data = view
    return saved


def load_inputs(saved: list[SavedTensor], mpu: ModelParallelUnit | None) -> list[torch.Tensor]:
    """Rebuild the full input tensors kept by ``save_inputs``."""
    tensors = []
    for s in saved:
        data = s.data.to(s.device)
        if s.partitioned:
            world = mpu.get_model_parallel_world_size()
            full = torch.empty(world * data.numel(), dtype=s.dtype, device=s.device)
            _all_gather_flat(full, data.contiguous(), mpu.get_model_parallel_group())
            data = full[: math.prod(s.shape)]
        tensors.append(data.reshape(s.shape))
    return tensors
