"""How much CPU and GPU memory ZeRO needs for model states (params, gradients, Adam states).

[Note: memory estimator formulas]
The formulas are DeepSpeed's documented ones ("Memory Requirements" chapter), in bytes, with
``P`` total parameters, ``L`` the largest layer's parameters, ``n`` GPUs per node, ``N`` GPUs in
all, ``f`` ``additional_buffer_factor`` and ``g = n / N``:

ZeRO-2       GPU                      CPU
  opt=cpu    2P                       P * max(4n, 16) * f
  opt=none   4P + 16P/N               4P * n * f           (only while the model is built on CPU)

ZeRO-3 (``LL = 4L``: fp16 params gathered + fp16 grads of the largest layer)
                      GPU             CPU, zero_init=1     CPU, zero_init=0
  param=cpu,  opt=cpu   LL            18P * g * f          P * max(4n, 18g) * f
  param=none, opt=cpu   LL + 2P/N     16P * g * f          P * max(4n, 16g) * f
  param=none, opt=none  LL + 18P/N    4L * n * f           4P * n * f

Tables print gibibytes labelled ``GB`` with two decimals, as DeepSpeed's do (so its worked
examples reproduce digit for digit). Every function also returns the rows as data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_profiler.report import count_params, param_numel

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """One row of an estimate: bytes per CPU (node) and per GPU for one set of options."""

    cpu_bytes: float
    gpu_bytes: float
    offload_param: str | None  # None for ZeRO-2, which cannot offload parameters
    offload_optimizer: str
    zero_init: bool | None  # None for ZeRO-2

    @property
    def cpu_gb(self) -> float:
        """CPU memory in GiB (DeepSpeed's tables call it GB)."""
        return self.cpu_bytes / GIB

    @property
    def gpu_gb(self) -> float:
        return self.gpu_bytes / GIB

    def options(self) -> str:
        if self.offload_param is None:
            return f"offload_optimizer={self.offload_optimizer}"
        return (
            f"offload_param={self.offload_param:4}, offload_optimizer={self.offload_optimizer:4}, "
            f"zero_init={int(bool(self.zero_init))}"
        )


def _check_count(name: str, value, where: str, minimum: float = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ValueError(f"{where}: {name} must be a number >= {minimum}, got {value!r}")


def _check_hw(where: str, num_gpus_per_node, num_nodes, additional_buffer_factor) -> None:
    for name, value in (("num_gpus_per_node", num_gpus_per_node), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name} must be an int >= 1, got {value!r}")
    _check_count("additional_buffer_factor", additional_buffer_factor, where, minimum=1.0)


def _header(total_params: float, num_gpus_per_node: int, num_nodes: int, largest: float | None) -> str:
    nodes = f"{num_nodes} node{'s' if num_nodes > 1 else ''}"
    gpus = f"{num_gpus_per_node} GPU{'s' if num_gpus_per_node > 1 else ''} per node"
    sw = f"SW: Model with {int(total_params / 1e6)}M total params"
    sw += f", {int(largest / 1e6)}M largest layer params." if largest is not None else "."
    return "\n".join(
        [
            "Estimated memory needed for params, optim states and gradients for a:",
            f"HW: Setup with {nodes}, {gpus}.",
            sw,
        ]
    )


def format_table(rows: list[MemoryEstimate], header: str) -> str:
    """The estimate table: header, column titles, one line per row."""
    lines = [header, f"{'per CPU':>11} | {'per GPU':>9} | Options"]
    lines += [f"{r.cpu_gb:9.2f}GB | {r.gpu_gb:7.2f}GB | {r.options()}" for r in rows]
    return "\n".join(lines)


def model_param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(total_params, largest_layer_params)``: shared parameters once; a layer's own parameters."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    total = count_params(model)
    largest = max(
        (sum(param_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0
    )
    return total, largest


# --- ZeRO-2 -------------------------------------------------------------------------------------


def zero2_rows(
    total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
):
    """The ZeRO-2 rows (optimizer offloaded to CPU, then not offloaded) as data."""
    p, n, f = float(total_params), num_gpus_per_node, additional_buffer_factor
    total_gpus = n * num_nodes
    return [
        MemoryEstimate(p * max(4 * n, 16) * f, 2 * p, None, "cpu", None),
        MemoryEstimate(p * 4 * n * f, 4 * p + 16 * p / total_gpus, None, "none", None),
    ]


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list[MemoryEstimate]:
    """Print (and return) ZeRO-2 memory needs of a hypothetical model with ``total_params`` params."""
    where = "estimate_zero2_model_states_mem_needs_all_cold"
    _check_count("total_params", total_params, where)
    _check_hw(where, num_gpus_per_node, num_nodes, additional_buffer_factor)
    rows = zero2_rows(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor)
    print(format_table(rows, _header(total_params, num_gpus_per_node, num_nodes, None)))
    return rows


def estimate_zero2_model_states_mem_needs_all_live(
    model: torch.nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> list[MemoryEstimate]:
    """Print (and return) ZeRO-2 memory needs of ``model`` (parameters counted from it)."""
    total, _ = model_param_counts(model)
    return estimate_zero2_model_states_mem_needs_all_cold(
        total, num_gpus_per_node, num_nodes, additional_buffer_factor
    )


# --- ZeRO-3 -------------------------------------------------------------------------------------


def zero3_rows(
    total_params: float,
    largest_layer_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
):
    """The six ZeRO-3 rows (param/optimizer offload x zero_init) as data."""
    p, big, n, f = (
        float(total_params),
        float(largest_layer_params),
        num_gpus_per_node,
        additional_buffer_factor,
    )
    total_gpus = n * num_nodes
    g = n / total_gpus
    ll = 4 * big
    rows = []
    for offload_param, offload_optimizer in (("cpu", "cpu"), ("none", "cpu"), ("none", "none")):
        if offload_param == "cpu":
            gpu = ll
        elif offload_optimizer == "cpu":
            gpu = ll + 2 * p / total_gpus
        else:
            gpu = ll + 18 * p / total_gpus
        for zero_init in (True, False):
            if offload_optimizer == "none":
                cpu = big * 4 * n * f if zero_init else p * 4 * n * f
            else:
                states = 18 if offload_param == "cpu" else 16
                cpu = p * states * g * f if zero_init else p * max(4 * n, states * g) * f
            rows.append(MemoryEstimate(cpu, gpu, offload_param, offload_optimizer, zero_init))
    return rows


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: float,
    largest_layer_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> list[MemoryEstimate]:
    """Print (and return) ZeRO-3 memory needs of a hypothetical model."""
    where = "estimate_zero3_model_states_mem_needs_all_cold"
    _check_count("total_params", total_params, where)
    _check_count("largest_layer_params", largest_layer_params, where, minimum=0)
    if largest_layer_params > total_params:
        raise ValueError(
            f"{where}: largest_layer_params ({largest_layer_params}) exceeds total_params ({total_params})"
        )
    _check_hw(where, num_gpus_per_node, num_nodes, additional_buffer_factor)
    rows = zero3_rows(
        total_params, largest_layer_params, num_gpus_per_node, num_nodes, additional_buffer_factor
    )
    print(format_table(rows, _header(total_params, num_gpus_per_node, num_nodes, largest_layer_params)))
    return rows


def estimate_zero3_model_states_mem_needs_all_live(
    model: torch.nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> list[MemoryEstimate]:
    """Print (and return) ZeRO-3 memory needs of ``model`` (total and largest layer from it)."""
    total, largest = model_param_counts(model)
    return estimate_zero3_model_states_mem_needs_all_cold(
        total, largest, num_gpus_per_node, num_nodes, additional_buffer_factor
    )


# --- the ZeRO paper's per-device model states ---------------------------------------------------


def zero_paper_model_states_bytes(
    total_params: float, num_devices: int, stage: int, optimizer_bytes_per_param: int = 12
) -> float:
    """Model-state bytes per device for mixed-precision Adam (ZeRO paper, Figure 1).

    2 bytes fp16 params + 2 bytes fp16 grads + K bytes optimizer states (K = 12 for Adam: fp32
    params, momentum, variance). Stage 0: (4 + K)P; 1 (P_os): 4P + KP/N; 2 (P_os+g):
    2P + (2 + K)P/N; 3 (P_os+g+p): (4 + K)P/N.
    """
    where = "zero_paper_model_states_bytes"
    _check_count("total_params", total_params, where)
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"{where}: num_devices must be an int >= 1, got {num_devices!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"{where}: stage must be 0, 1, 2 or 3, got {stage!r}")
    p, n, k = float(total_params), num_devices, optimizer_bytes_per_param
    return [(4 + k) * p, 4 * p + k * p / n, 2 * p + (2 + k) * p / n, (4 + k) * p / n][stage]
