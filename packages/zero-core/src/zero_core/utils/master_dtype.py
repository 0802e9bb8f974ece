"""The dtype of the optimizer's master weights: fp32, or bf16 in DeepSpeed's low-memory mode.

[Note: bf16 master weights]
With bf16 training every ZeRO stage keeps fp32 *master* weights by default: the optimizer steps
fp32 copies of the parameters (fp32 gradients, fp32 states) and the bf16 parameters are refreshed
from them. DeepSpeed 0.18 added a memory mode, two keys of the ``bf16`` section:
``bf16_master_weights_and_grads`` keeps the masters and the gradients the optimizer steps with in
bf16, and ``bf16_optimizer_states`` keeps the optimizer's states in bf16 too. DeepSpeed 0.19.8
accepts them at stages 1-3 only, the states key only with the masters key, and the masters key
without the states key only with ``offload_optimizer`` and its CPU Adam (which keeps fp32 states
on the host).

zero implements the two keys together, at stages 1-3 with ``bf16.enabled``, on the device: the
master *is* the parameters' bf16 shard (stage 3: the partition itself; stages 1-2: a view of the
flat bf16 parameter buffer when a rank's shard is one range of it, else a bf16 copy; as fp32
masters alias fp32 parameters, See [Note: fp32 master aliasing]), the reduced bf16 gradient shard
is handed to the optimizer as it is (no fp32 copy), and the client optimizer creates its states
in its parameters' dtype (torch's optimizers allocate ``zeros_like`` of the parameter): bf16. So
a bf16 master run is exactly a plain-PyTorch bf16 model stepped by a torch optimizer, sharded.
Model-state bytes per parameter with Adam over N ranks (``model_state_bytes_per_param``;
``engine.memory_breakdown()`` shows them, padding aside):

=====  ======================  ======================
stage  fp32 masters (default)  bf16 masters + states
=====  ======================  ======================
1      2 + 2 + (4 + 8)/N       2 + 2 + 4/N
2      2 + (2 + 4 + 8)/N       2 + (2 + 4)/N
3      (2 + 2 + 4 + 8)/N       (2 + 2 + 4)/N
=====  ======================  ======================

(parameters, gradients, masters, Adam's two moments; stage 1 keeps full bf16 gradients, stage 2
their shard). Refused with an error naming the key and what to set instead: the masters key
alone (fp32 states beside bf16 masters need DeepSpeed's offloaded CPU Adam), either key with
``offload_optimizer`` (zero-offload steps fp32 masters), stage 0, or without ``bf16.enabled``.
bf16 has an 8-bit mantissa: an update smaller than half a unit in the last place of a weight is
lost (round to nearest, no stochastic rounding, as in DeepSpeed), which is what the mode trades
for memory; ``tools/bench/results/bench_bf16_master.md`` measures it on the examples/ GPT.
"""

from __future__ import annotations

import torch

MASTER_DTYPES = (torch.float32, torch.bfloat16)


def check_master_dtype(master_dtype: object, dtype: torch.dtype, where: str, offloaded: bool = False) -> None:
    """``master_dtype`` is fp32, or bf16 with bf16 training and masters kept on the device
    (``offloaded``: the optimizer is offloaded). See [Note: bf16 master weights]."""
    if master_dtype not in MASTER_DTYPES:
        raise ValueError(
            f"{where}: master_dtype must be torch.float32 or torch.bfloat16, got {master_dtype!r}"
        )
    if master_dtype == torch.bfloat16 and dtype != torch.bfloat16:
        raise ValueError(f"{where}: bf16 master weights need bf16 training, got training dtype {dtype}")
    if master_dtype == torch.bfloat16 and offloaded:
        raise ValueError(
            f"{where}: bf16 master weights cannot be offloaded (offload_optimizer steps fp32 masters)"
        )


def model_state_bytes_per_param(stage: int, world: int, bf16_masters: bool) -> float:
    """Bytes of model states per parameter with bf16 training and Adam on ``world`` ranks, padding
    aside: the table of [Note: bf16 master weights] (bf16 masters that alias the parameters; at
    stages 1-2 a layout of several chunks per group keeps a bf16 copy instead, 2/N more)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"model_state_bytes_per_param: stage must be 1, 2 or 3, got {stage!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"model_state_bytes_per_param: world must be an int >= 1, got {world!r}")
    masters, states = (0, 4) if bf16_masters else (4, 8)
    params = 2 if stage < 3 else 2 / world
    grads = 2 if stage == 1 else 2 / world
    return params + grads + (masters + states) / world
