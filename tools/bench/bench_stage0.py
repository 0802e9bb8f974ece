"""Step time and peak RSS per rank of ZeRO stage 0 (``zero_core.initialize``) against torch DDP.

The demo's GPT (examples/gpt.py, d_model 512, 6 layers, ~19M parameters), 2 ranks over gloo,
micro-batch 4 x 128 tokens, AdamW (torch's default implementation for both), no clipping.

* fp32: both train fp32 parameters.
* bf16: ours is the engine's bf16 mode (bf16 module and gradients, bf16 all-reduce, fp32 master
  weights and AdamW states); DDP is what a torch user writes for bf16 on CPU: fp32 parameters and
  ``torch.autocast("cpu", dtype=torch.bfloat16)`` (fp32 gradients and all-reduce).

Step time: all four engines live in ONE 2-rank launch and take turns (two steps each per round),
so machine noise hits them alike; step = forward + backward + optimizer step, timed on rank 0;
median and [min, max] after warm-up, ratio = ours / DDP of the same precision (ratio of the
medians, and the median over rounds of the within-round ratio).
CPU-time ratio: median CPU seconds per step of rank 0's process (all threads), ours / DDP: the
work each engine does, unaffected by other jobs' load (but blind to overlap).
Peak RSS per rank: each engine again in a fresh pair of forked ranks (VmHWM of the process, reset
with /proc/self/clear_refs when the rank starts, read after the steps), max over the ranks.

Run: OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_stage0.py [--rounds 4] [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_env import cpu_model, git_commit

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_stage0_gpt", ROOT / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
sys.modules["bench_stage0_gpt"] = gpt  # dataclasses look their module up
_spec.loader.exec_module(gpt)

MICRO, SEQ, LR = 4, 128, 1e-4
VARIANTS = [("ddp", "fp32"), ("zero", "fp32"), ("ddp", "bf16"), ("zero", "bf16")]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(d_model=512, n_layers=6, n_heads=8, seq_len=SEQ))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randint(0, 256, (MICRO, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


class _DDPRunner:
    def __init__(self, precision: str) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = DDP(_model())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.autocast = precision == "bf16"

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


class _ZeroRunner:
    def __init__(self, precision: str) -> None:
        import zero_core

        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 10**9,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 0},
            "bf16": {"enabled": precision == "bf16"},
        }
        self.engine, _, _, _ = zero_core.initialize(
            model=_model(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), config=cfg
        )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())


def _runner(name: str, precision: str):
    return _DDPRunner(precision) if name == "ddp" else _ZeroRunner(precision)


def _timing(rounds: int, warmup: int) -> dict:
    import zero_core  # noqa: F401 - the harness has initialised the gloo group
    from zero_core import comm

    rank = comm.get_rank()
    runners = {v: _runner(*v) for v in VARIANTS}
    times: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
    losses: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
    # CPU seconds of this rank's process (all its threads, gloo's included): robust to other jobs'
    # load on a shared machine, which inflates wall time but not the work done
    cpu: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
    for r in range(warmup + rounds):
        for v, runner in runners.items():
            for s in range(2):
                x, y = _batch(2 * r + s, rank)
                t0, c0 = time.perf_counter(), time.process_time()
                losses[v].append(runner.step(x, y))
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if r >= warmup:
                    times[v].append(dt)
                    cpu[v].append(dc)
    return {"times": times, "cpu": cpu, "losses": losses}


def _vm_hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _peak_rss(name: str, precision: str, steps: int) -> int:
    from zero_core import comm

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    runner = _runner(name, precision)
    for s in range(steps):
        runner.step(*_batch(s, comm.get_rank()))
    return _vm_hwm_kib() * 1024


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4, help="timed rounds (each: 2 steps of every engine)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--rss_steps", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "tools" / "bench" / "results" / "bench_stage0.md"))
    args = p.parse_args(argv)
    for name, value in (("rounds", args.rounds), ("rss_steps", args.rss_steps)):
        if value < 1:
            raise SystemExit(f"bench_stage0: --{name} must be >= 1, got {value}")
    if args.warmup < 0:
        raise SystemExit(f"bench_stage0: --warmup must be >= 0, got {args.warmup}")
    from zero_core.testing import run_multirank

    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    timing = run_multirank(_timing, 2, args=(args.rounds, args.warmup), timeout=600)[0]
    rss = {v: max(run_multirank(_peak_rss, 2, args=(*v, args.rss_steps), timeout=300)) for v in VARIANTS}
    total = time.perf_counter() - start
    load_after = os.getloadavg()[0]

    n_params = gpt.num_params(_model())
    rows = []
    per_round = 2  # steps of each engine per round

    def paired_ratio(name: str, precision: str) -> float:
        """Median over rounds of ours / DDP within the round: robust to load that drifts between rounds."""
        ours, ddp = timing["times"][(name, precision)], timing["times"][("ddp", precision)]
        return statistics.median(
            sum(ours[i : i + per_round]) / sum(ddp[i : i + per_round]) for i in range(0, len(ours), per_round)
        )

    for name, precision in VARIANTS:
        t = [1000 * x for x in timing["times"][(name, precision)]]
        med = statistics.median(t)
        base = statistics.median(timing["times"][("ddp", precision)]) * 1000
        rows.append(
            (
                precision,
                "torch DDP" if name == "ddp" else "zero stage 0",
                med,
                min(t),
                max(t),
                med / base,
                paired_ratio(name, precision),
                statistics.median(timing["cpu"][(name, precision)])
                / statistics.median(timing["cpu"][("ddp", precision)]),
                rss[(name, precision)] / 2**30,
            )
        )
    lines = [
        "# bench_stage0: ZeRO stage 0 vs torch DDP, 2 ranks (gloo, CPU)",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.system()} {platform.release()}; shared with "
        "other jobs: compare the ratios of one run, not absolute times across runs; 1-minute load average "
        f"{load_before:.1f} at start, {load_after:.1f} at end",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- git commit: {git_commit('packages/zero-core/src', 'tools/bench/bench_stage0.py')}",
        f"- command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} .venv/bin/python "
        f"tools/bench/bench_stage0.py --rounds {args.rounds} --warmup {args.warmup} --rss_steps {args.rss_steps}`",
        f"- model: examples/gpt.py GPT d_model 512, 6 layers, 8 heads, seq 128, {n_params / 1e6:.1f}M parameters; "
        f"micro-batch {MICRO} per rank; AdamW lr {LR}; no clipping",
        "- bf16: ours = bf16 module + fp32 master weights and AdamW states (engine `bf16.enabled`); "
        'DDP = fp32 parameters under `torch.autocast("cpu", torch.bfloat16)`',
        f"- timed steps per engine: {2 * args.rounds} (after {2 * args.warmup} warm-up), engines alternating "
        f"in one launch; peak RSS: fresh ranks per engine, {args.rss_steps} steps; bench wall time {total:.0f} s",
        "",
        "| precision | engine | step median (ms) | min | max | ratio of medians vs DDP "
        "| median per-round ratio vs DDP | CPU-time ratio vs DDP | peak RSS / rank (GiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {pr} | {eng} | {med:.0f} | {lo:.0f} | {hi:.0f} | {ratio:.3f} | {paired:.3f} | {cpu_ratio:.3f} "
        f"| {r:.2f} |"
        for pr, eng, med, lo, hi, ratio, paired, cpu_ratio, r in rows
    ]
    first = {v: timing["losses"][v][0] for v in VARIANTS}
    lines += [
        "",
        "First-step loss per engine (same model and data): "
        + ", ".join(f"{n} {pr} {first[(n, pr)]:.4f}" for n, pr in VARIANTS),
    ]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
