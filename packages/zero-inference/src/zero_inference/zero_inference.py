"""ZeRO-Inference: each layer's weights partitioned over ranks and gathered just for its forward.

[Note: ZeRO-Inference partitioning]
With ``zero: {stage: 3}`` every transformer layer (the repeated modules of the model, see
[Note: auto TP discovery]) keeps only ``1/world`` of each of its parameters, flattened and
padded. A forward pre-hook all-gathers the layer's parameters (``zero_core.comm``) into full
tensors, a forward hook frees them again, so at most one layer is materialised at a time.
With ``offload_param.device: cpu`` the partitions live in (optionally pinned) CPU memory and
are copied to the compute device before the gather; ``nvme`` needs the zero-offload package.
Modules outside the layers (embeddings, final norm, head) stay whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn
from zero_core import comm
from zero_core.config import ZeroOptimizationConfig
from zero_core.plugins import require

from zero_inference.auto_tp import _auto_layer_classes


class ZeroInferencePartitioner:
    """Partitions ``model``'s layers and installs the gather/free hooks. See [Note: ZeRO-Inference partitioning]."""

    def __init__(self, model: nn.Module, config: ZeroOptimizationConfig) -> None:
        self.world = comm.get_world_size() if comm.is_initialized() else 1
        self.rank = comm.get_rank() if comm.is_initialized() else 0
        offload = config.offload_param
        self.offload_device = offload.device if offload is not None and offload.enabled else "none"
        if self.offload_device == "nvme":
            offload_pkg = require("zero_offload", "zero.offload_param.device=nvme (ZeRO-Inference to NVMe)")
            raise NotImplementedError(
                f"ZeRO-Inference NVMe offload is not wired to {offload_pkg.__name__} yet; use offload_param.device=cpu"
            )
        self.pin = bool(offload is not None and offload.pin_memory and torch.cuda.is_available())
        self.layers = [m for m in model.modules() if type(m) in _auto_layer_classes(model)]
        if not self.layers:
            raise ValueError(
                f"ZeRO-Inference found no transformer layers to partition in {type(model).__name__}"
            )
        self.handles = []
        self.partitions: dict[int, list[tuple[nn.Parameter, torch.Size, torch.Tensor]]] = {}
        for layer in self.layers:
            self._partition(layer)
            self.handles.append(layer.register_forward_pre_hook(self._gather))
            self.handles.append(layer.register_forward_hook(self._release))

    def _partition(self, layer: nn.Module) -> None:
        parts = []
        for p in layer.parameters():
            flat = p.data.reshape(-1)
            per = -(-flat.numel() // self.world)
            padded = torch.zeros(per * self.world, dtype=flat.dtype, device=flat.device)
            padded[: flat.numel()] = flat
            shard = padded[self.rank * per : (self.rank + 1) * per].clone()
            if self.offload_device == "cpu":
                shard = shard.cpu().pin_memory() if self.pin else shard.cpu()
            parts.append((p, p.shape, shard, p.device))
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.partitions[id(layer)] = parts

    def _gather(self, layer: nn.Module, args: object) -> None:
        for p, shape, shard, device in self.partitions[id(layer)]:
            local = shard.to(device, non_blocking=self.pin)
            if self.world > 1:
                full = torch.empty(local.numel() * self.world, dtype=local.dtype, device=device)
                comm.all_gather_into_tensor(full, local)
            else:
                full = local
            p.data = full[: shape.numel()].view(shape)

    def _release(self, layer: nn.Module, args: object, output: object) -> None:
        for p, _, _, device in self.partitions[id(layer)]:
            p.data = torch.empty(0, dtype=p.dtype, device=device)

    def partition_numel(self) -> int:
        """Elements this rank holds for the partitioned layers."""
        return sum(shard.numel() for parts in self.partitions.values() for _, _, shard, _ in parts)
