"""Host-side building blocks of ``OptimizerOffload``: Adam settings, host buffers, per-group bookkeeping.

``_adam_settings`` maps a client optimizer's param group onto zero-ops' CPUAdam
hyper-parameters (or rejects what the CPU step cannot do); ``_host_empty`` allocates the flat
host buffers (pinned when asked and CUDA is present); ``_Group`` records one param group's
offloaded masters as offsets into those buffers. Kept apart from the class so the step
(``offload_step``) and the state access (``offload_state``) share them without importing
``optimizer_offload``. See [Note: optimizer offload hook] in optimizer_offload.py.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_offload.nvme_swapper import StateSwapper
from zero_offload.transfers import host_buffer

_MASTER = "fp32_master"  # the masters' swapped array (See [Note: masters on NVMe])
_GRAD = "grad"  # the staged gradients' swapped array (See [Note: ZeRO-Infinity streaming])
_NOT_STATES = (_MASTER, _GRAD)  # swapped arrays that are not optimizer states


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _adam_settings(optimizer: torch.optim.Optimizer, group: dict[str, Any], gi: int) -> dict[str, Any]:
    """The CPUAdam hyper-parameters equivalent to ``group`` of ``optimizer`` (or a clear error)."""
    kind = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.AdamW):
        adamw = True
    elif isinstance(optimizer, torch.optim.Adam):
        adamw = bool(group.get("decoupled_weight_decay", False))
    elif "adamw_mode" in group and "betas" in group:  # zero_ops CPUAdam (and DeepSpeed-style Adams)
        adamw = bool(group["adamw_mode"])
    else:
        raise ValueError(
            f"zero_optimization.offload_optimizer: the optimizer step runs zero-ops' CPUAdam on the CPU, which "
            f"implements Adam/AdamW; got {kind}. Use torch.optim.Adam/AdamW, zero.ops.adam.CPUAdam, or the "
            '"optimizer": {"type": "Adam"|"AdamW"} config section (or disable offload_optimizer)'
        )
    for flag in ("maximize", "capturable", "differentiable"):
        if group.get(flag, False):
            raise ValueError(
                f"zero_optimization.offload_optimizer: {kind} param_groups[{gi}] sets {flag}=True, which the "
                "CPU Adam step does not support"
            )
    lr = group["lr"]
    if torch.is_tensor(lr):
        lr = float(lr)
    return {
        "lr": float(lr),
        "betas": tuple(float(b) for b in group["betas"]),
        "eps": float(group["eps"]),
        "weight_decay": float(group.get("weight_decay", 0.0)),
        "adamw_mode": adamw,
        "bias_correction": bool(group.get("bias_correction", True)),
        "amsgrad": bool(group.get("amsgrad", False)),
    }


def _host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return host_buffer(numel, dtype, pin)  # pinned through the accelerator: See [Note: offload copies]


def _unallocated(shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of ``shape`` whose storage holds no memory (a streamed master's placeholder).

    ``torch.empty`` reserves address space the kernel backs only when touched; the storage is
    then resized to zero bytes, so RSS never sees it."""
    t = torch.empty(shape, dtype=dtype)
    t.untyped_storage().resize_(0)
    return t


class _Group:
    """One optimizer param group's offloaded masters, flat."""

    def __init__(self, index: int, numels: list[int]) -> None:
        self.index = index
        self.offsets = [0]
        for n in numels:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        self.master: torch.Tensor = torch.empty(0)
        self.grad: torch.Tensor = torch.empty(0)
        self.low: torch.Tensor | None = None
        self.device_low: torch.Tensor | None = None
        self.states: dict[str, torch.Tensor] = {}
        self.swapper: StateSwapper | None = None
        self.params: list[torch.nn.Parameter] = []
