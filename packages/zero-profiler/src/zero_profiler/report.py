"""Text of a profile: summary, top modules per depth, and the annotated module tree.

The layout follows DeepSpeed's flops profiler output (summary, "Aggregated Profile per GPU",
"Detailed Profile per GPU") so that users can read it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_profiler.tracking import ModuleStats
from zero_profiler.units import (
    duration_to_string,
    flops_rate_to_string,
    flops_to_string,
    macs_to_string,
    params_to_string,
)

# Attributes holding the full element count of a partitioned (ZeRO stage 3) parameter whose
# local tensor is a shard or empty: zero-core's name first, then DeepSpeed's.
FULL_NUMEL_ATTRS = ("zero_numel", "ds_numel")


def param_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter ``p``, also when this rank holds only a ZeRO-3 shard.

    Under ZeRO stage 3 ``p.numel()`` is 0 (released) or the full size (gathered); the
    partitioner records the full count as ``p.zero_numel`` (zero-core) or ``p.ds_numel``
    (DeepSpeed), which is used when present.
    """
    for attr in FULL_NUMEL_ATTRS:
        n = getattr(p, attr, None)
        if n is not None:
            return int(n)
    return p.numel()


def count_params(module: torch.nn.Module) -> int:
    """Parameters of ``module`` and its children, each shared tensor counted once.

    Parameters are deduplicated by identity (``Module.parameters`` already does) and, for real
    unpartitioned storage, by data pointer too, so two ``Parameter`` objects viewing one tensor
    count once. Partitioned parameters count their full size (:func:`param_numel`).
    """
    seen: set = set()
    total = 0
    for p in module.parameters():
        partitioned = any(hasattr(p, attr) for attr in FULL_NUMEL_ATTRS)
        if partitioned or p.device.type == "meta" or not p.numel():
            key = id(p)
        else:
            key = (p.data_ptr(), p.dtype, tuple(p.shape))
        if key in seen:
            continue
        seen.add(key)
        total += param_numel(p)
    return total


def effective_stats(model: torch.nn.Module, stats: dict[torch.nn.Module, ModuleStats]) -> dict:
    """Per-module stats for printing: a module never called shows the sum of its children.

    Containers such as ``nn.ModuleList`` are never called themselves (their owner iterates over
    them), so their own counters are 0; like DeepSpeed, the profile shows the sum of their
    children's (recursively) instead. Called modules keep their own inclusive counters.
    """
    out: dict[torch.nn.Module, ModuleStats] = {}

    def visit(m: torch.nn.Module) -> ModuleStats:
        if m in out:
            return out[m]
        s = stats.get(m, ModuleStats())
        children = [visit(child) for child in m.children()]
        if s.calls == 0:
            total = ModuleStats()
            for c in children:
                total.fwd_flops += c.fwd_flops
                total.fwd_macs += c.fwd_macs
                total.bwd_flops += c.bwd_flops
                total.bwd_macs += c.bwd_macs
                total.recompute_flops += c.recompute_flops
                total.recompute_macs += c.recompute_macs
                total.fwd_duration += c.fwd_duration
            s = total
        out[m] = s
        return s

    visit(model)
    return out


@dataclass
class Summary:
    """What the header of a profile reports."""

    step: int
    world_size: int
    dp_size: int
    mp_size: int
    batch_size: int | None
    params: int
    fwd_flops: int
    fwd_macs: int
    bwd_flops: int | None
    train_flops: int
    fwd_latency: float
    bwd_latency: float | None
    step_latency: float | None


def _depth_map(model: torch.nn.Module) -> dict[torch.nn.Module, int]:
    depths: dict[torch.nn.Module, int] = {}

    def visit(m: torch.nn.Module, d: int) -> None:
        if m in depths:
            return
        depths[m] = d
        for child in m.children():
            visit(child, d + 1)

    visit(model, 0)
    return depths


def summary_text(s: Summary) -> str:
    lines = [
        "\n-------------------------- Zero Flops Profiler --------------------------",
        f"Profile Summary at step {s.step}:",
        "Notations:",
        "data parallel size (dp_size), model parallel size(mp_size),",
        "number of parameters (params), number of multiply-accumulate operations(MACs),",
        "number of floating-point operations (flops), floating-point operations per second (FLOPS),",
        "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
        "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n",
    ]
    width = 60

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<{width}}{value}")

    row("world size:", str(s.world_size))
    row("data parallel size:", str(s.dp_size))
    row("model parallel size:", str(s.mp_size))
    if s.batch_size is not None:
        row("batch size per GPU:", str(s.batch_size))
    row("params per GPU:", params_to_string(s.params))
    row("params of model = params per GPU * mp_size:", params_to_string(s.params * s.mp_size))
    row("fwd MACs per GPU:", macs_to_string(s.fwd_macs))
    row("fwd flops per GPU:", flops_to_string(s.fwd_flops))
    row("fwd flops of model = fwd flops per GPU * mp_size:", flops_to_string(s.fwd_flops * s.mp_size))
    if s.bwd_flops is not None:
        row("bwd flops per GPU (measured):", flops_to_string(s.bwd_flops))
    row("fwd+bwd flops per GPU:", flops_to_string(s.train_flops))
    row("fwd latency:", duration_to_string(s.fwd_latency))
    if s.fwd_latency > 0:
        row(
            "fwd FLOPS per GPU = fwd flops per GPU / fwd latency:",
            flops_rate_to_string(s.fwd_flops / s.fwd_latency),
        )
    if s.bwd_latency is not None:
        row("bwd latency:", duration_to_string(s.bwd_latency))
        if s.bwd_latency > 0:
            bwd = s.train_flops - s.fwd_flops
            row(
                "bwd FLOPS per GPU = bwd flops per GPU / bwd latency:",
                flops_rate_to_string(bwd / s.bwd_latency),
            )
        total_latency = s.fwd_latency + s.bwd_latency
        if total_latency > 0:
            row(
                "fwd+bwd FLOPS per GPU = fwd+bwd flops per GPU / (fwd+bwd latency):",
                flops_rate_to_string(s.train_flops / total_latency),
            )
    if s.step_latency is not None:
        row("step latency:", duration_to_string(s.step_latency))
        iter_latency = s.fwd_latency + (s.bwd_latency or 0.0) + s.step_latency
        row("iter latency:", duration_to_string(iter_latency))
        if s.batch_size and iter_latency > 0:
            row("samples/second:", f"{s.batch_size * s.dp_size / iter_latency:.2f}")
    return "\n".join(lines)


def aggregated_rows(
    model: torch.nn.Module, stats: dict[torch.nn.Module, ModuleStats], module_depth: int, top_modules: int
) -> list[tuple[int, dict[str, list[tuple[str, float]]]]]:
    """Per depth: the top ``top_modules`` module classes by params, MACs and fwd latency.

    Modules at one depth are grouped by class name and summed (DeepSpeed's aggregation).
    ``module_depth=-1`` means every depth.
    """
    depths = _depth_map(model)
    stats = effective_stats(model, stats)
    max_depth = max(depths.values())
    wanted = range(max_depth + 1) if module_depth < 0 else range(min(module_depth, max_depth) + 1)
    out = []
    for d in wanted:
        groups: dict[str, list[float]] = {}
        for m, md in depths.items():
            if md != d:
                continue
            s = stats.get(m, ModuleStats())
            g = groups.setdefault(type(m).__name__, [0, 0, 0.0])
            g[0] += count_params(m)
            g[1] += s.fwd_macs
            g[2] += s.fwd_duration
        ranked = {}
        for key, idx in (("params", 0), ("MACs", 1), ("fwd latency", 2)):
            order = sorted(groups.items(), key=lambda kv, i=idx: kv[1][i], reverse=True)[:top_modules]
            ranked[key] = [(name, vals[idx]) for name, vals in order]
        out.append((d, ranked))
    return out


def aggregated_text(
    model: torch.nn.Module, stats: dict[torch.nn.Module, ModuleStats], module_depth: int, top_modules: int
) -> str:
    fmt = {"params": params_to_string, "MACs": macs_to_string, "fwd latency": duration_to_string}
    lines = [
        "\n----------------------------- Aggregated Profile per GPU -----------------------------",
        f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:",
    ]
    for d, ranked in aggregated_rows(model, stats, module_depth, top_modules):
        lines.append(f"depth {d}:")
        for key, items in ranked.items():
            body = ", ".join(f"'{name}': '{fmt[key](v)}'" for name, v in items)
            lines.append(f"    {key:<11} - {{{body}}}")
    return "\n".join(lines)


def detailed_text(
    model: torch.nn.Module,
    stats: dict[torch.nn.Module, ModuleStats],
    module_depth: int,
    show_backward: bool,
) -> str:
    """The module tree, each module annotated with its profile (DeepSpeed's detailed layout)."""
    stats = effective_stats(model, stats)
    root = stats.get(model, ModuleStats())
    total_params = max(count_params(model), 1)
    total_macs = max(root.fwd_macs, 1)
    total_time = root.fwd_duration if root.fwd_duration > 0 else 1.0
    order = "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
    order += "percentage of total fwd latency, fwd FLOPS"
    if show_backward:
        order += ", bwd flops"
    lines = [
        "\n------------------------------ Detailed Profile per GPU ------------------------------",
        "Each module profile is listed after its name in the following order:",
        order,
        "",
        "Note: 1. A module's profile includes every operator executed while its forward ran,",
        "children and functional calls included; a module called n times accumulates n calls.",
        "2. Operators outside any module (e.g. the loss) are not attributed to the model.",
        "3. A module that was never called itself (e.g. a ModuleList) shows the sum of its children.\n",
    ]

    def profile(m: torch.nn.Module) -> str:
        s = stats.get(m, ModuleStats())
        params = count_params(m)
        parts = [
            params_to_string(params),
            f"{100 * params / total_params:.2f}% Params",
            macs_to_string(s.fwd_macs),
            f"{100 * s.fwd_macs / total_macs:.2f}% MACs",
            duration_to_string(s.fwd_duration),
            f"{100 * s.fwd_duration / total_time:.2f}% latency",
            flops_rate_to_string(s.fwd_flops / s.fwd_duration if s.fwd_duration > 0 else 0.0),
        ]
        if show_backward:
            parts.append(f"{flops_to_string(s.bwd_flops)}bwd flops")
        return ", ".join(parts)

    def visit(m: torch.nn.Module, name: str | None, depth: int, indent: str) -> None:
        head = f"{indent}({name}): " if name is not None else indent
        children = list(m.named_children())
        extra = m.extra_repr()
        show_children = children and (module_depth < 0 or depth < module_depth)
        if not show_children:
            suffix = f", {extra}" if extra else ""
            lines.append(f"{head}{type(m).__name__}({profile(m)}{suffix})")
            return
        lines.append(f"{head}{type(m).__name__}(")
        lines.append(f"{indent}  {profile(m)}" + (f", {extra}" if extra else ""))
        for child_name, child in children:
            visit(child, child_name, depth + 1, indent + "  ")
        lines.append(f"{indent})")

    visit(model, None, 0, "")
    lines.append("------------------------------------------------------------------------------")
    return "\n".join(lines)
