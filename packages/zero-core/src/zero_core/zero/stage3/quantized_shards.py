"""``zero_quantized_nontrainable_weights``: frozen weights' shards kept int8-quantized.

[Note: quantized frozen shards]
A frozen weight (``requires_grad=False``: an embedding or a LoRA base) has no master and is never
updated, so ZeRO++ keeps its shard quantized: int8 values plus one fp32 scale per block of 256
(see [Note: block quantization]), about half the bytes of a 16-bit shard. It is a transient
shard store, as parameter offload is (``st.store``; See [Note: shard store seam]): ``st.shard``
holds no memory except while a gather packs it, when ``fetch`` dequantizes into it and
``release`` frees it again; reads and writes (checkpoints, modifiers) go through :meth:`read` /
:meth:`write`. So the stored values *are* the quantized ones: every
gather, including ``GatheredParameters``, sees them, and a checkpoint saves them (dequantized, in
the plain stage-3 format).

Frozen weights travel quantized in every all-gather (forward and backward), each shard padded to
whole blocks so the blocks on the wire are the stored ones and re-quantizing the dequantized shard
reproduces the stored values exactly (no second rounding). A frozen weight that
``offload_param`` already placed off the device keeps that placement and is not quantized.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zero_core.comm.quantize import Quantized, dequantize, quantize_blocks
from zero_core.comm.quantized_collectives import WEIGHT_BITS, WEIGHT_BLOCK
from zero_core.protocols.shard_store import PLAIN_SHARDS
from zero_core.zero.stage3.param_records import partition_state
from zero_core.zero.stage3.transient_shards import TransientShards

if TYPE_CHECKING:
    from zero_core.zero.stage3.partitioned_param import PartitionState


class QuantizedShardStore(TransientShards):
    """Holds the int8 shards of frozen parameters; see [Note: quantized frozen shards]. A
    transient shard store (See [Note: shard store seam]): fetch and release are ``TransientShards``'."""

    def __init__(self) -> None:
        self._q: dict[int, Quantized] = {}

    @torch.no_grad()
    def adopt(self, params: list[torch.nn.Parameter]) -> None:
        """Quantize the shards of the frozen ``params`` that no other store holds, freeing them."""
        for p in params:
            st = partition_state(p)
            if p.requires_grad or st.store.transient:
                continue
            self._q[st.id] = quantize_blocks(st.shard, WEIGHT_BITS, WEIGHT_BLOCK)
            st.shard.untyped_storage().resize_(0)
            st.store = self

    def owns(self, p: torch.nn.Parameter) -> bool:
        return partition_state(p).id in self._q

    def _fill(self, st: PartitionState) -> None:
        """The dequantized values (nothing is read ahead: dequantizing is local)."""
        st.shard.copy_(dequantize(self._q[st.id], st.shard.dtype))

    @torch.no_grad()
    def read(self, st: PartitionState) -> torch.Tensor:
        return dequantize(self._q[st.id], st.shard.dtype)

    @torch.no_grad()
    def write(self, st: PartitionState, values: torch.Tensor) -> None:
        v = values.detach().reshape(-1)[: st.shard_numel].to(device=st.shard.device, dtype=st.shard.dtype)
        self._q[st.id] = quantize_blocks(v, WEIGHT_BITS, WEIGHT_BLOCK)
        if st.shard.untyped_storage().nbytes() > 0:
            st.shard.copy_(dequantize(self._q[st.id], st.shard.dtype))

    @torch.no_grad()
    def set_dtype(self, p: torch.nn.Parameter, dtype: torch.dtype) -> None:
        """Hand the shard back as a plain tensor (``set_shard_dtype`` then casts it)."""
        st = partition_state(p)
        values = self.read(st)
        st.store = PLAIN_SHARDS
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
