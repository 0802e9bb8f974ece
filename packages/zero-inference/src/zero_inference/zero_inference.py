"""ZeRO-Inference: each layer's weights partitioned over ranks and gathered just for its forward.

[Note: ZeRO-Inference partitioning]
With ``zero: {stage: 3}`` every transformer layer (the repeated modules of the model, see
[Note: auto TP discovery]) keeps only ``1/world`` of each of its parameters, flattened and
padded. A forward pre-hook all-gathers the layer's parameters (``zero_core.comm``) into full
tensors, a forward hook frees them again, so at most one layer is materialised at a time.
Modules outside the layers (embeddings, final norm, head) stay whole on every rank.

Where the partitions live (``offload_param.device``):
* ``none``: on the compute device;
* ``cpu``: in (optionally pinned) CPU memory, copied to the compute device before the gather;
* ``nvme``: in files under ``offload_param.nvme_path``, written and read through an
  ``OffloadBackend`` (see [Note: NVMe offload backend]). While layer ``i`` runs, layer ``i+1``'s
  partitions are already being read asynchronously (one layer of prefetch; after the last layer
  the first one is prefetched for the next forward), so at most two layers' partitions are in
  memory.
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
        self.backend = None
        if self.offload_device == "nvme":
            # zero-offload's store (See [Note: NVMe offload backend] there)
            store = require(
                "zero_offload.backends", "ZeRO-Inference NVMe offload (offload_param.device=nvme)"
            )
            self.backend = store.NvmeOffloadBackend(offload.nvme_path, rank=self.rank)
        self.pin = bool(offload is not None and offload.pin_memory and torch.cuda.is_available())
        self.layers = [m for m in model.modules() if type(m) in _auto_layer_classes(model)]
        if not self.layers:
            raise ValueError(
                f"ZeRO-Inference found no transformer layers to partition in {type(model).__name__}"
            )
        self._index = {id(layer): i for i, layer in enumerate(self.layers)}
        self.handles = []
        # layer id -> [(param, full shape, shard or None when on NVMe, device, shard numel, dtype)]
        self.partitions: dict[int, list[tuple]] = {}
        self._prefetched: dict[int, list[torch.Tensor]] = {}
        for layer in self.layers:
            self._partition(layer)
            self.handles.append(layer.register_forward_pre_hook(self._gather))
            self.handles.append(layer.register_forward_hook(self._release))

    def _key(self, layer: nn.Module, j: int) -> str:
        return f"layer{self._index[id(layer)]}.param{j}"

    def _partition(self, layer: nn.Module) -> None:
        parts = []
        for j, p in enumerate(layer.parameters()):
            flat = p.data.reshape(-1)
            per = -(-flat.numel() // self.world)
            padded = torch.zeros(per * self.world, dtype=flat.dtype, device=flat.device)
            padded[: flat.numel()] = flat
            shard = padded[self.rank * per : (self.rank + 1) * per].clone()
            if self.offload_device == "cpu":
                shard = shard.cpu().pin_memory() if self.pin else shard.cpu()
            elif self.backend is not None:
                self.backend.swap_out(self._key(layer, j), shard)
                shard = None
            parts.append((p, p.shape, shard, p.device, per, p.dtype))
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.partitions[id(layer)] = parts

    def _read_nvme(self, layer: nn.Module, async_op: bool) -> list[torch.Tensor]:
        bufs = []
        for j, (_, _, _, _, per, dtype) in enumerate(self.partitions[id(layer)]):
            buf = torch.empty(per, dtype=dtype)
            self.backend.swap_in(self._key(layer, j), buf, async_op=async_op)
            bufs.append(buf)
        return bufs

    def _local_shards(self, layer: nn.Module) -> list[torch.Tensor]:
        if self.backend is None:
            return [part[2] for part in self.partitions[id(layer)]]
        bufs = self._prefetched.pop(id(layer), None)
        if bufs is None:
            bufs = self._read_nvme(layer, async_op=False)
        else:
            self.backend.wait()
        nxt = self.layers[(self._index[id(layer)] + 1) % len(self.layers)]
        if id(nxt) not in self._prefetched:
            self._prefetched[id(nxt)] = self._read_nvme(nxt, async_op=True)
        return bufs

    def _gather(self, layer: nn.Module, args: object) -> None:
        shards = self._local_shards(layer)
        for (p, shape, _, device, _, _), shard in zip(self.partitions[id(layer)], shards):
            local = shard.to(device, non_blocking=self.pin)
            if self.world > 1:
                full = torch.empty(local.numel() * self.world, dtype=local.dtype, device=device)
                comm.all_gather_into_tensor(full, local)
            else:
                full = local
            p.data = full[: shape.numel()].view(shape)

    def _release(self, layer: nn.Module, args: object, output: object) -> None:
        for p, _, _, device, _, _ in self.partitions[id(layer)]:
            p.data = torch.empty(0, dtype=p.dtype, device=device)

    def close(self) -> None:
        """Remove the hooks and free the offload store (NVMe files and I/O threads)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self._prefetched.clear()
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def partition_numel(self) -> int:
        """Elements this rank holds for the partitioned layers (on the device, CPU or NVMe)."""
        return sum(part[4] for parts in self.partitions.values() for part in parts)
