"""Benchmark of the zero-moe MoE layer: tokens/s for 8 experts on 2 ranks, ep_size 1 vs 2,
and the all-to-all volume per step against theory.

Run:  OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_moe.py
Writes tools/bench/results/bench_moe.md. Each rank runs forward + backward of one MoE layer on
its own tokens (fp32, gloo, 1 thread per rank); ep_size=1 replicates the 8 experts on both
ranks, ep_size=2 shards them 4 + 4 and exchanges tokens with all-to-all.

Theory (capacity path): every all-to-all moves the whole ``[E, C, M]`` buffer, of which
``(ep-1)/ep`` leaves the rank; a step (forward + backward) has 4 of them (dispatch and combine,
and their gradients). Ragged dropless path: each all-to-all moves the ``k * S`` routed rows whose
expert lives on another rank; with balanced routing that is ``(ep-1)/ep`` of them.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_env import cpu_model, git_commit
from torch import nn

M, H, E, S = 256, 1024, 8, 2048
WARMUP, ITERS = 2, 10
CASES = [  # (label, k, kwargs)
    ("top-1, capacity 1.0", 1, {"capacity_factor": 1.0}),
    ("top-2, capacity 1.0", 2, {"capacity_factor": 1.0}),
    ("top-2, dropless ragged", 2, {"drop_tokens": False}),
]


def _worker() -> list[dict]:
    from zero_core import comm as _dist  # zero-moe's exchanges go through zero_core.comm
    from zero_moe import MoE, reduce_moe_gradients

    rank = dist.get_rank()
    sent = {"total": 0, "off_rank": 0, "calls": 0}
    real = _dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        if input.dtype.is_floating_point:  # the token exchanges, not the int64 count exchange
            world = dist.get_world_size(group)
            me = dist.get_rank(group)
            row = input[0].numel() * input.element_size() if input.shape[0] else 0
            splits = input_split_sizes or [input.shape[0] // world] * world
            sent["total"] += input.numel() * input.element_size()
            sent["off_rank"] += sum(s for i, s in enumerate(splits) if i != me) * row
            sent["calls"] += 1
        return real(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    _dist.all_to_all_single = counting
    rows = []
    for label, k, kwargs in CASES:
        models = {}
        for ep in (1, 2):
            torch.manual_seed(0)
            expert = nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M))
            models[ep] = MoE(
                M,
                expert,
                num_experts=E,
                ep_size=ep,
                k=k,
                min_capacity=0,
                use_rts=False,
                top2_2nd_expert_sampling=False,
                **kwargs,
            )
        # requires_grad: the layer sits inside a network, so the input gradient is computed
        # (and the dispatch all-to-all has a backward exchange).
        x = torch.randn(S, M, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
        times: dict[int, list[float]] = {1: [], 2: []}
        volume = {ep: {"total": 0, "off_rank": 0, "calls": 0} for ep in (1, 2)}
        # ep 1 and ep 2 steps alternate, so drift in the shared machine's load hits both alike.
        for it in range(WARMUP + ITERS):
            for ep, moe in models.items():
                sent.update(total=0, off_rank=0, calls=0)
                dist.barrier()
                t0 = time.perf_counter()
                out, l_aux, _ = moe(x)
                (out.square().mean() + l_aux).backward()
                reduce_moe_gradients(moe)
                dist.barrier()
                elapsed = time.perf_counter() - t0
                moe.zero_grad(set_to_none=True)
                if it >= WARMUP:
                    times[ep].append(elapsed)
                    for key in volume[ep]:
                        volume[ep][key] += sent[key]
        for ep, moe in models.items():
            steady = times[ep]
            rows.append(
                {
                    "case": label,
                    "ep": ep,
                    "median_s": statistics.median(steady),
                    "min_s": min(steady),
                    "max_s": max(steady),
                    "tokens_per_s": S / statistics.median(steady),
                    "a2a_calls": volume[ep]["calls"] / ITERS,
                    "a2a_total": volume[ep]["total"] / ITERS,
                    "a2a_off": volume[ep]["off_rank"] / ITERS,
                    "capacity": moe.zero_moe.gate(x).capacity,
                    "k": k,
                    "expert_params": sum(p.numel() for p in moe.zero_moe.experts.parameters()),
                }
            )
    _dist.all_to_all_single = real
    return rows


def _theory(row: dict) -> float | None:
    ep = row["ep"]
    if ep == 1:
        return 0.0
    if row["capacity"] is None:  # ragged: k*S rows, (ep-1)/ep off-rank if balanced, x4 exchanges
        return 4 * row["k"] * S * M * 4 * (ep - 1) / ep
    return 4 * E * row["capacity"] * M * 4 * (ep - 1) / ep


def main() -> None:
    from zero_core.testing import run_multirank

    t_start = time.perf_counter()
    results = run_multirank(_worker, 2, timeout=400)
    wall = time.perf_counter() - t_start
    root = Path(__file__).resolve().parents[2]
    commit = git_commit("packages/zero-moe", "tools/bench/bench_moe.py")
    cpu = cpu_model()
    lines = [
        "# bench_moe: MoE layer throughput and all-to-all volume, 8 experts, 2 ranks",
        "",
        f"- machine: nproc={os.cpu_count()}, CPU: {cpu}; gloo, 1 thread per rank",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- git commit: {commit}",
        f"- command: `OMP_NUM_THREADS=1 {Path(sys.executable).name} tools/bench/bench_moe.py`",
        f"- workload per rank and step: forward + backward + reduce_moe_gradients of one MoE layer, "
        f"{S} tokens x hidden {M}, experts Linear({M},{H})-GELU-Linear({H},{M}), fp32; "
        f"{WARMUP} warm-up + {ITERS} timed steps; wall for the whole run {wall:.0f} s",
        "- tokens/s: tokens of one rank / median step time (both ranks step together). "
        "ratio: ep_size=2 time / ep_size=1 time, same case, same run.",
        "- a2a volume: bytes handed to all_to_all_single per rank per step (token exchanges only), "
        "and the part leaving the rank, against the theory in the module docstring.",
        "",
        "| case | ep_size | expert params/rank | capacity | median step ms (min-max, rank 0) | tokens/s/rank | "
        "ratio vs ep 1 | a2a calls | a2a MiB total | a2a MiB off-rank | theory MiB off-rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["case"], r["ep"]): r for r in results[0]}
    mib = 2**20
    for r in results[0]:
        base = by_key[(r["case"], 1)]["median_s"]
        theory = _theory(r)
        lines.append(
            f"| {r['case']} | {r['ep']} | {r['expert_params']:,} | {r['capacity'] or 'none (ragged)'} | "
            f"{r['median_s'] * 1e3:.1f} ({r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f}) | "
            f"{r['tokens_per_s']:,.0f} | {r['median_s'] / base:.2f} | {r['a2a_calls']:.0f} | "
            f"{r['a2a_total'] / mib:.2f} | {r['a2a_off'] / mib:.2f} | {theory / mib:.2f} |"
        )
    r1 = {(r["case"], r["ep"]): r for r in results[1]}
    lines += [
        "",
        "Notes: both ep sizes compute the same number of expert rows per rank (ep 1: 8 experts x own "
        "tokens; ep 2: 4 experts x both ranks' tokens). ep 1 all-reduces the gradients of all 8 experts "
        "(16.8 MB fp32) over gloo every step; ep 2 has an expert-data-parallel group of size 1 (no expert "
        "all-reduce) but 4 all-to-alls. ep 2 halves expert memory per rank. The machine is shared with "
        "other jobs (see the min-max spread): compare ratios within one run only.",
    ]
    lines += [
        "",
        "Rank 1 off-rank MiB per step (ragged volume depends on each rank's routing): "
        + ", ".join(f"{c} ep={e}: {r1[(c, e)]['a2a_off'] / mib:.2f}" for c, e in r1 if e == 2),
    ]
    out = root / "tools" / "bench" / "results" / "bench_moe.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
