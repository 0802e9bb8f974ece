"""``zero_quantized_nontrainable_weights``: frozen weights' shards kept int8-quantized.

[Note: quantized frozen shards]
A frozen weight (``requires_grad=False``: an embedding or a LoRA base) has no master and is never
updated, so ZeRO++ keeps its shard quantized: int8 values plus one fp32 scale per block of 256
(see [Note: block quantization]), about half the bytes of a 16-bit shard. The store plugs into
the shard-location hooks that parameter offload uses (``st.offload``; see [Note: offloaded
shards]): ``st.shard`` holds no memory except while a gather packs it, when :meth:`fetch`
dequantizes into it and :meth:`release` frees it again; reads and writes (checkpoints, modifiers)
go through :meth:`read` / :meth:`write`. So the stored values *are* the quantized ones: every
gather, including ``GatheredParameters``, sees them, and a checkpoint saves them (dequantized, in
the plain stage-3 format).

Frozen weights travel quantized in every all-gather (forward and backward), each shard padded to
whole blocks so the blocks on the wire are the stored ones and re-quantizing the dequantized shard
reproduces the stored values exactly (no second rounding). A frozen weight that
``offload_param`` already placed off the device keeps that placement and is not quantized.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_core.comm.quantize import Quantized, dequantize, quantize_blocks
from zero_core.comm.quantized_collectives import WEIGHT_BITS, WEIGHT_BLOCK
from zero_core.zero.stage3.param_records import partition_state


class QuantizedShardStore:
    """Holds the int8 shards of frozen parameters; see [Note: quantized frozen shards]."""

    def __init__(self) -> None:
        self._q: dict[int, Quantized] = {}
        self.coordinator: Any = None

    @torch.no_grad()
    def adopt(self, params: list[torch.nn.Parameter]) -> None:
        """Quantize the shards of the frozen ``params`` that no other store holds, freeing them."""
        for p in params:
            st = partition_state(p)
            if p.requires_grad or st.offload is not None:
                continue
            self._q[st.id] = quantize_blocks(st.shard, WEIGHT_BITS, WEIGHT_BLOCK)
            st.shard.untyped_storage().resize_(0)
            st.offload = self

    def owns(self, p: torch.nn.Parameter) -> bool:
        return partition_state(p).id in self._q

    def follow(self, coordinator: Any) -> None:
        """Part of the shard-store interface; nothing is read ahead (dequantizing is local)."""
        self.coordinator = coordinator

    @torch.no_grad()
    def fetch(self, p: torch.nn.Parameter) -> None:
        """Fill ``st.shard`` with the dequantized values (before a gather packs it)."""
        st = partition_state(p)
        if st.shard.untyped_storage().nbytes() > 0:
            return
        st.shard.untyped_storage().resize_(st.shard_numel * st.shard.element_size())
        st.shard.copy_(dequantize(self._q[st.id], st.shard.dtype))

    def release(self, p: torch.nn.Parameter) -> None:
        partition_state(p).shard.untyped_storage().resize_(0)

    @torch.no_grad()
    def read(self, p: torch.nn.Parameter) -> torch.Tensor:
        st = partition_state(p)
        return dequantize(self._q[st.id], st.shard.dtype)

    @torch.no_grad()
    def write(self, p: torch.nn.Parameter, values: torch.Tensor) -> None:
        st = partition_state(p)
        v = values.detach().reshape(-1)[: st.shard_numel].to(device=st.shard.device, dtype=st.shard.dtype)
        self._q[st.id] = quantize_blocks(v, WEIGHT_BITS, WEIGHT_BLOCK)
        if st.shard.untyped_storage().nbytes() > 0:
            st.shard.copy_(dequantize(self._q[st.id], st.shard.dtype))

    @torch.no_grad()
    def set_dtype(self, p: torch.nn.Parameter, dtype: torch.dtype) -> None:
        """Hand the shard back as a plain ``dtype`` tensor (``set_shard_dtype`` then casts it)."""
        st = partition_state(p)
        values = self.read(p)
        st.offload = None
        del self._q[st.id]
        st.shard = torch.empty(st.shard_numel, dtype=st.shard.dtype, device=st.shard.device)
        st.shard.copy_(values)
        p.zero_shard = st.shard

    def memory_breakdown(self) -> dict[str, int]:
        return {
            "quantized_parameters": sum(
                q.payload.numel() + q.scales.numel() * q.scales.element_size() for q in self._q.values()
            )
        }

    def close(self) -> None:
        self._q.clear()
