"""Model-state bytes per rank and bytes on the wire per step of ZeRO stages 0-3 at N = 2, 4, 8, against the ZeRO paper.

The ZeRO paper (Rajbhandari et al., arXiv 1910.02054) gives, for Ψ parameters, mixed precision and
Adam (K = 12 bytes of fp32 master, momentum and variance per parameter):

* model states per rank: stage 0 (2+2+K)Ψ, stage 1 (2+2)Ψ + KΨ/N, stage 2 2Ψ + (2+K)Ψ/N,
  stage 3 (2+2+K)Ψ/N;
* communication per rank and step: stages 0-2 move 2Ψ elements (an all-reduce, or a
  reduce-scatter plus an all-gather), stage 3 3Ψ (parameters all-gathered in forward and again in
  backward, gradients reduce-scattered), each scaled by (N-1)/N on a ring.

In fp32 our stages keep one copy of each parameter (the master aliases it, [Note: fp32 master
aliasing]), so the formulas become stage 0 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N,
stage 3 16Ψ/N, with 4-byte elements on the wire.

Measured: ``engine.memory_breakdown()`` after backward of the second step (parameters, gradients,
master weights and optimizer states; bucket buffers apart), and the comms logger over one whole
step (forward, backward, optimizer step), each op's logical bytes times its ring factor
(``bus_bandwidth_factor``: 2(N-1)/N for all-reduce, (N-1)/N for reduce-scatter and all-gather).
Bytes do not depend on speed, so 8 ranks time-sharing 2 cores give exact figures.

Writes tools/bench/results/bench_scaling.md and bench_scaling.png.
Run: OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_scaling.py [--worlds 2,4,8]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
from bench_env import cpu_model, git_commit

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tools" / "bench" / "results" / "bench_scaling.md"
DIM, LAYERS, MICRO = 256, 6, 4
STATE_KEYS = ("parameters", "gradients", "master_weights", "optimizer_states")


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(DIM, DIM), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(DIM, 8))


def theory_states(stage: int, precision: str, psi: int, n: int) -> float:
    """The ZeRO paper's model-state bytes per rank (fp32: one aliased copy of the parameters)."""
    if precision == "bf16":
        p, g, k = 2, 2, 12
        return {0: (p + g + k) * psi, 1: (p + g) * psi + k * psi / n, 2: p * psi + (g + k) * psi / n}.get(
            stage, (p + g + k) * psi / n
        )
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n}.get(stage, 16 * psi / n)


def theory_wire(stage: int, precision: str, psi: int, n: int) -> float:
    """Bytes each rank sends per step on a ring: 2Ψ elements for stages 0-2, 3Ψ for stage 3."""
    elem = 2 if precision == "bf16" else 4
    return (3 if stage == 3 else 2) * psi * elem * (n - 1) / n


def _measure_rank(precisions: list[str]) -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.comm.logger import bus_bandwidth_factor

    out: dict = {}
    for precision in precisions:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for stage in (0, 1, 2, 3):
            model = _model()
            psi = sum(p.numel() for p in model.parameters())
            cfg = {
                "train_micro_batch_size_per_gpu": MICRO,
                "steps_per_print": 10**9,
                "gradient_clipping": 0.0,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
                # one bucket for the whole model; every stage-3 parameter partitioned and released after use
                "zero_optimization": {
                    "stage": stage,
                    "reduce_bucket_size": 10**8,
                    "allgather_bucket_size": 10**8,
                    "stage3_param_persistence_threshold": 0,
                    "stage3_max_reuse_distance": 0,  # re-gather in backward, as the paper counts
                },
            }
            if precision == "bf16":
                cfg["bf16"] = {"enabled": True}
            engine = zero_core.initialize(model=model, config=cfg)[0]

            def step(engine=engine, dtype=dtype) -> dict[str, int]:
                x = torch.randn(MICRO, DIM, dtype=dtype)
                engine.backward(engine(x).float().pow(2).mean())
                mem = engine.memory_breakdown()
                engine.step()
                return mem

            step()  # Adam's states exist from here on
            comm.comms_logger.reset()
            comm.comms_logger.enable()
            mem = step()
            comm.comms_logger.disable()
            wire = sum(
                st.bytes * bus_bandwidth_factor(op, len(ranks))
                for (op, ranks), st in comm.comms_logger.summary().items()
            )
            comm.comms_logger.reset()
            out[(precision, stage)] = {
                "psi": psi,
                "states": sum(mem[k] for k in STATE_KEYS),
                "buffers": mem.get("buffers", 0),
                "wire": wire,
            }
            engine.destroy()
            del engine, model
    return out


def _plot(rows: dict, worlds: list[int], precisions: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(precisions), 2, figsize=(11, 4.2 * len(precisions)), squeeze=False)
    colors = {0: "tab:gray", 1: "tab:blue", 2: "tab:green", 3: "tab:red"}
    for row, precision in enumerate(precisions):
        for col, (key, theory, title) in enumerate(
            (
                ("states", theory_states, "model states per rank"),
                ("wire", theory_wire, "bytes sent per rank per step"),
            )
        ):
            ax = axes[row][col]
            for stage in (0, 1, 2, 3):
                psi = rows[(worlds[0], precision, stage)]["psi"]
                meas = [rows[(n, precision, stage)][key] / psi for n in worlds]
                th = [theory(stage, precision, psi, n) / psi for n in worlds]
                ax.plot(worlds, th, "--", color=colors[stage], alpha=0.6)
                ax.plot(worlds, meas, "o", color=colors[stage], label=f"stage {stage}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(worlds, [str(n) for n in worlds])
            ax.set_xlabel("ranks N")
            ax.set_ylabel("bytes / Ψ")
            ax.set_title(f"{precision}: {title}")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle("dots: measured; dashes: ZeRO formula (stages 0-2 move the same bytes: their dots coincide)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--precisions", default="bf16,fp32")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    try:
        worlds = [int(w) for w in a.worlds.split(",")]
    except ValueError:
        raise SystemExit(f"--worlds must be comma-separated integers, got {a.worlds!r}") from None
    precisions = a.precisions.split(",")
    if any(w < 2 for w in worlds) or not set(precisions) <= {"bf16", "fp32"}:
        raise SystemExit("--worlds: integers >= 2; --precisions: a subset of bf16,fp32")
    from zero_core.testing import run_multirank

    t0 = time.perf_counter()
    rows: dict = {}
    for n in worlds:
        per_rank = run_multirank(_measure_rank, n, args=(precisions,), timeout=1800)
        for (precision, stage), r in per_rank[0].items():  # rank 0: shards of 0 are the largest
            r["states"] = max(pr[(precision, stage)]["states"] for pr in per_rank)
            rows[(n, precision, stage)] = r
    elapsed = time.perf_counter() - t0
    out = Path(a.out)
    png = out.with_suffix(".png")
    _plot(rows, worlds, precisions, png)
    psi = rows[(worlds[0], precisions[0], 0)]["psi"]
    lines = [
        "# bench_scaling: model-state bytes and bytes on the wire per rank, ZeRO stages 0-3 at N = "
        + ", ".join(map(str, worlds)),
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()} (bytes do not depend on load)",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- git commit: {git_commit('packages/zero-core', 'tools/bench/bench_scaling.py')}",
        f"- command: `OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_scaling.py --worlds {a.worlds} "
        f"--precisions {a.precisions}`",
        f"- model: {LAYERS + 1} Linear layers of width {DIM}, Ψ = {psi:,}; Adam; one bucket; stage 3 partitions "
        "every parameter and releases it after use (stage3_max_reuse_distance 0; the default keeps a parameter "
        f"used again soon, and then backward gathers less than the paper's Ψ); run time {elapsed:.0f} s",
        "- states: parameters + gradients + master weights + optimizer states after backward (max over ranks); "
        "wire: the comms logger's bytes over one step times the ring factor of each op, per rank",
        f"- plot: [{png.name}]({png.name})",
        "",
        "| precision | stage | N | states (bytes/Ψ) | ZeRO formula | wire (bytes/Ψ) | ZeRO formula |",
        "|---|---|---|---|---|---|---|",
    ]
    for precision in precisions:
        for stage in (0, 1, 2, 3):
            for n in worlds:
                r = rows[(n, precision, stage)]
                lines.append(
                    f"| {precision} | {stage} | {n} | {r['states'] / psi:.2f} "
                    f"| {theory_states(stage, precision, psi, n) / psi:.2f} | {r['wire'] / psi:.2f} "
                    f"| {theory_wire(stage, precision, psi, n) / psi:.2f} |"
                )
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
