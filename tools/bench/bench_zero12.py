"""Step time and per-rank memory of ZeRO stages 0, 1, 2 against torch DDP (2 ranks, gloo, CPU).

Same GPT (examples/gpt.py), same micro-batch, same Adam, every variant in its own pair of
forked ranks (so peak RSS is per variant). Step time = forward + backward + optimizer step,
median over the timed steps after warm-up; ratios are against DDP measured in the same run.
Model-state bytes come from live tensors (``engine.memory_breakdown()``; for DDP the
parameters, gradients and Adam states). A second pass at 4 ranks reports model-state bytes
only (bf16 + Adam, the setting of the ZeRO paper's formulas, and fp32).

Run: OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_zero12.py [--steps 8] [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_gpt", ROOT / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
sys.modules["bench_gpt"] = gpt  # dataclasses look their module up
_spec.loader.exec_module(gpt)

MICRO = 4
BUCKET = 50_000_000


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(d_model=256, n_layers=4, n_heads=4, seq_len=128))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randint(0, 256, (MICRO, 129), generator=g)
    return x[:, :-1], x[:, 1:]


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _variant(name: str, steps: int, precision: str = "fp32", time_it: bool = True) -> dict:
    import zero_core
    from zero_core import comm

    rank = comm.get_rank()
    model = _model()
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, bucket_cap_mb=BUCKET * 4 / 2**20)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step_fn(s: int) -> None:
            x, y = _batch(s, rank)
            ddp(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)  # keep gradients: they are part of DDP's model states

        def states() -> int:
            st = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
            return _bytes(model.parameters()) + _bytes(p.grad for p in model.parameters()) + _bytes(st)
    else:
        stage = int(name[-1])
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 10**9,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}},
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": BUCKET,
                "allgather_bucket_size": BUCKET,
                "overlap_comm": True,
            },
        }
        if precision != "fp32":
            cfg[precision] = {"enabled": True}
        engine = zero_core.initialize(model=model, config=cfg)[0]
        peak = {"states": 0}

        def step_fn(s: int) -> None:
            x, y = _batch(s, rank)
            engine.backward(engine(x, y))
            peak["states"] = max(peak["states"], sum(engine.memory_breakdown().values()))
            engine.step()

        def states() -> int:
            return peak["states"]

    times = []
    for s in range(steps + 2):
        comm.barrier()
        t = time.perf_counter()
        step_fn(s)
        if s >= 2:
            times.append(time.perf_counter() - t)
        if not time_it and s >= 1:
            break
    return {
        "times": times,
        "states": states(),
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "params": sum(p.numel() for p in model.parameters()),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
            + " (plus uncommitted changes)"
        )
    except (OSError, subprocess.CalledProcessError):
        return "uncommitted"


def main() -> None:
    from zero_core.testing import run_multirank

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "tools" / "bench" / "results" / "bench_zero12.md"))
    args = ap.parse_args()
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")

    rows = {}
    for _rep in range(2):  # interleave two passes: the machine is shared and noisy
        for name in ("ddp", "stage0", "stage1", "stage2"):
            res = run_multirank(_variant, 2, args=(name, args.steps), timeout=600)
            r = rows.setdefault(name, {"times": [], "states": 0, "rss": 0, "params": res[0]["params"]})
            for rr in res:
                r["times"] += rr["times"]
                r["states"] = max(r["states"], rr["states"])
                r["rss"] = max(r["rss"], rr["rss"])
    mem4 = {}
    for precision in ("bf16", "fp32"):
        for name in ("ddp", "stage0", "stage1", "stage2"):
            if name == "ddp" and precision == "bf16":
                continue
            res = run_multirank(_variant, 4, args=(name, 1, precision, False), timeout=600)
            mem4[(name, precision)] = max(rr["states"] for rr in res)

    psi = rows["ddp"]["params"]
    base = statistics.median(rows["ddp"]["times"])
    lines = [
        "# bench_zero12: ZeRO stages 0/1/2 vs torch DDP (CPU, gloo)",
        "",
        f"- machine: {os.cpu_count()} CPUs ({_cpu_model()}), {platform.platform()}",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- git commit: {_commit()}",
        f"- command: `OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_zero12.py --steps {args.steps}`",
        f"- model: examples/gpt.py GPT d_model 256, 4 layers, seq 128, Ψ = {psi:,} parameters; micro-batch {MICRO} "
        f"per rank; Adam; buckets {BUCKET:,} elements; overlap_comm on; fp32",
        "- each variant ran twice (interleaved) on 2 forked ranks; times pooled over ranks and passes",
        "- DeepSpeed was not run in this benchmark (it needs its own venv, see /work/shared/notes/baselines.md)",
        "",
        "## 2 ranks, fp32: step time and memory per rank",
        "",
        "| variant | median step (ms) | p10-p90 (ms) | ratio vs DDP | model states/rank (MiB) | ratio | peak RSS/rank (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        t = sorted(r["times"])
        med = statistics.median(t)
        p10, p90 = t[int(0.1 * (len(t) - 1))], t[int(0.9 * (len(t) - 1))]
        lines.append(
            f"| {name} | {med * 1e3:.1f} | {p10 * 1e3:.1f}-{p90 * 1e3:.1f} | {med / base:.2f} | "
            f"{r['states'] / 2**20:.1f} | {r['states'] / rows['ddp']['states']:.2f} | {r['rss'] / 2**20:.0f} |"
        )
    lines += [
        "",
        "## 4 ranks: model-state bytes per rank (live tensors, max over ranks)",
        "",
        "| variant | precision | model states/rank (MiB) | ratio vs DDP fp32 |",
        "|---|---|---|---|",
    ]
    ddp4 = mem4[("ddp", "fp32")]
    for (name, precision), b in mem4.items():
        lines.append(f"| {name} | {precision} | {b / 2**20:.1f} | {b / ddp4:.2f} |")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
