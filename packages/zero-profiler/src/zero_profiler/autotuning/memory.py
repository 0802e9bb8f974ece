"""Memory for the autotuner: the model states each ZeRO stage needs, and what the device has.

The model-state figure is the ZeRO paper's (arXiv 1910.02054, Figure 1): with mixed precision
(fp16/bf16) and Adam, 2 bytes of parameters + 2 of gradients + K = 12 of optimizer states
(fp32 master copy, momentum, variance) per parameter, of which stage 1 partitions the optimizer
states over the N data-parallel ranks, stage 2 also the gradients, stage 3 also the parameters.
That estimator is zero-profiler's own (``zero_profiler.memory_estimators.zero_paper_model_states_bytes``)
and is used for mixed-precision runs; for fp32 training (4 bytes of parameters and of gradients,
K = 8: momentum and variance, no master copy) the same partitioning is computed here.
Offloading the optimizer states (``offload_optimizer``) moves their K bytes off the device.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from zero_profiler.memory_estimators import zero_paper_model_states_bytes

if TYPE_CHECKING:
    from zero_core.config.builtin_sections import AutotuningConfig

#: environment override of the memory budget (bytes; "64MB", "2GiB" also accepted), for tests
BUDGET_ENV = "ZERO_AUTOTUNING_MEMORY_BUDGET"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str, where: str) -> int:
    """``"1000"``, ``"64MB"``, ``"2GiB"`` -> bytes; a clear error naming ``where`` otherwise."""
    raw = str(text).strip().upper().replace(" ", "")
    number = raw.rstrip("KMGIB")
    unit = raw[len(number) :]
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ValueError(
            f"{where}: {text!r} is not a byte count (an integer, or a number with one of "
            f"{sorted(u for u in _UNITS if u)})"
        ) from None
    if value < 1:
        raise ValueError(f"{where}: the memory budget must be >= 1 byte, got {text!r}")
    return int(value)


def model_states_bytes(
    num_params: int, world_size: int, stage: int, mixed_precision: bool, offload_optimizer: bool = False
) -> float:
    """Model-state bytes per device for Adam-style training at ZeRO ``stage`` (see module doc)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"model_states_bytes: stage must be 0, 1, 2 or 3, got {stage!r}")
    if num_params < 1 or world_size < 1:
        raise ValueError(
            f"model_states_bytes: num_params and world_size must be >= 1, got {num_params}, {world_size}"
        )
    p, n = float(num_params), world_size
    if mixed_precision and not offload_optimizer:
        return float(zero_paper_model_states_bytes(num_params, world_size, stage))
    param_b, grad_b, k = (2, 2, 12) if mixed_precision else (4, 4, 8)
    if offload_optimizer:
        k = 0
    shards = [(1, 1, 1), (1, 1, n), (1, n, n), (n, n, n)][stage]
    return p * (param_b / shards[0] + grad_b / shards[1] + k / shards[2])


def _host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the physical pages the OS reports."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def device_memory_budget(section: AutotuningConfig, ranks_per_node: int) -> tuple[int, str]:
    """(bytes one rank may use, where that figure came from).

    Order: the ``ZERO_AUTOTUNING_MEMORY_BUDGET`` environment variable, the section's
    ``memory_budget``, the free memory of CUDA device 0, host RAM available divided by the ranks
    on this node (the CPU accelerator's ranks share it)."""
    env = os.environ.get(BUDGET_ENV)
    if env:
        return parse_bytes(env, BUDGET_ENV), f"{BUDGET_ENV}={env}"
    if getattr(section, "memory_budget", None):
        return int(section.memory_budget), "autotuning.memory_budget"
    import torch

    if torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(0)
        return int(free), f"free memory of {torch.cuda.get_device_name(0)}"
    avail = _host_available_bytes()
    per_rank = avail // max(1, ranks_per_node)
    return per_rank, f"host RAM available ({avail / 2**30:.1f} GiB) / {ranks_per_node} ranks"


def device_is_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()
