"""Profiling overhead and FLOP-count accuracy on a small GPT forward: zero-profiler vs the others.

Compares, in one process, a plain forward against the same forward under zero_profiler's
FlopsProfiler, DeepSpeed's FlopsProfiler, torch.utils.flop_counter.FlopCounterMode, fvcore and
ptflops (whichever import), and each tool's FLOP count against the analytic truth.

Run (in a /tmp bench venv holding torch, deepspeed, fvcore, ptflops and zero-profiler):
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python tools/bench/bench_profiler.py --out tools/bench/results/bench_profiler.md
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import subprocess
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

B, T, C, H, LAYERS, VOCAB = 4, 128, 256, 8, 4, 8192


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(C)
        self.head = nn.Linear(C, VOCAB, bias=False)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def analytic():
    """(matmul-only FLOPs = 2 * MACs, full FLOPs under zero-profiler's conventions)."""
    bt, hd = B * T, C // H
    mm = LAYERS * (2 * bt * C * 3 * C + 2 * bt * C * C + 2 * bt * C * 4 * C * 2) + 2 * bt * C * VOCAB
    attn_mm = LAYERS * 2 * B * H * T * T * 2 * hd
    softmax = LAYERS * B * H * T * T
    elementwise = bt * C + LAYERS * (5 * bt * C * 2 + bt * C * 2 + bt * 4 * C) + 5 * bt * C
    return mm + attn_mm, mm + attn_mm + softmax + elementwise


def timeit(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT().eval()
    ids = torch.randint(0, VOCAB, (B, T))
    quiet = contextlib.redirect_stdout(io.StringIO())

    def plain():
        with torch.no_grad():
            model(ids)

    tools = {}  # name -> (profiled forward callable returning flops)

    from zero_profiler import FlopsProfiler as ZeroProfiler

    def zero_run():
        p = ZeroProfiler(model)
        p.start_profile()
        plain()
        p.stop_profile()
        f = p.get_total_flops()
        p.end_profile()
        return f

    tools["zero-profiler"] = zero_run
    try:
        from deepspeed.profiling.flops_profiler import FlopsProfiler as DSProfiler

        def ds_run():
            p = DSProfiler(model)
            p.start_profile()
            plain()
            p.stop_profile()
            f = p.get_total_flops()
            p.end_profile()
            return f

        tools["deepspeed 0.19.8"] = ds_run
    except ImportError as err:
        print("deepspeed unavailable:", err)
    from torch.utils.flop_counter import FlopCounterMode

    def fc_run():
        with FlopCounterMode(display=False) as fc:
            plain()
        return fc.get_total_flops()

    tools["torch FlopCounterMode"] = fc_run
    try:
        from fvcore.nn import FlopCountAnalysis

        def fv_run():
            with quiet:
                a = FlopCountAnalysis(model, ids)
                a.unsupported_ops_warnings(False)
                a.uncalled_modules_warnings(False)
                return 2 * a.total()  # fvcore counts one MAC as one "flop"

        tools["fvcore (x2: counts MACs)"] = fv_run
    except ImportError as err:
        print("fvcore unavailable:", err)
    try:
        from ptflops import get_model_complexity_info

        def pt_run():
            with quiet:
                macs, _ = get_model_complexity_info(
                    model, (B, T), input_constructor=lambda _: {"ids": ids}, as_strings=False,
                    print_per_layer_stat=False, verbose=False, backend="pytorch",
                )  # fmt: skip
            return 2 * macs

        tools["ptflops (x2: counts MACs)"] = pt_run
    except ImportError as err:
        print("ptflops unavailable:", err)

    mm_truth, full_truth = analytic()
    for fn in [plain, *tools.values()]:  # warm up every path once
        with quiet:
            fn()
    # Interleave reps so that machine noise hits every tool alike.
    times = {name: [] for name in ["plain", *tools]}
    counts = {}
    for _ in range(args.reps):
        times["plain"] += timeit(plain, 1)
        for name, fn in tools.items():
            t0 = time.perf_counter()
            with quiet:
                counts[name] = fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["plain"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        spread = f"{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}"
        c = counts.get(name)
        cnt = "" if c is None else f"{c / 1e9:.4f} G"
        err = (
            ""
            if c is None
            else f"{100 * (c - full_truth) / full_truth:+.2f}% / {100 * (c - mm_truth) / mm_truth:+.2f}%"
        )
        rows.append(f"| {name} | {med * 1e3:.1f} | {spread} | {med / base:.3f} | {cnt} | {err} |")
    try:
        commit = subprocess.check_output(
            ["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
        dirty = subprocess.check_output(
            ["git", "status", "--porcelain", "--", "packages/zero-profiler"], text=True
        )
        commit += " (zero-profiler uncommitted changes)" if dirty.strip() else ""
    except Exception:
        commit = "uncommitted"
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    import importlib.metadata as md

    def ver(d):
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            return "not installed"

    text = (
        f"""# bench_profiler: profiling overhead and FLOP accuracy, small GPT forward

Machine: nproc={os.cpu_count()}, {cpu}; Python {platform.python_version()}; torch {torch.__version__};
deepspeed {ver("deepspeed")}; fvcore {ver("fvcore")}; ptflops {ver("ptflops")}; zero-profiler {ver("zero-profiler")}.
Git commit: {commit}. OMP_NUM_THREADS={os.environ.get("OMP_NUM_THREADS", "unset")}.
Command: `DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python tools/bench/bench_profiler.py --reps {args.reps} --out tools/bench/results/bench_profiler.md`

Model: GPT, batch {B} x seq {T}, hidden {C}, {H} heads, {LAYERS} layers, vocab {VOCAB}; fp32, eval, no_grad.
Each profiled time covers one forward plus the tool's start/stop (for fvcore: its JIT trace; for ptflops: its
hook setup). {args.reps} interleaved reps per tool, median and min-max.

Analytic truth: matmul-only {mm_truth / 1e9:.4f} G (2 x MACs of every product, attention's QK^T and PV included);
full {full_truth / 1e9:.4f} G (plus softmax, layer norms, GELU and adds under zero-profiler's conventions).
Error column: vs full / vs matmul-only.

| tool | median ms | spread ms | ratio vs plain | FLOPs counted | error |
|---|---|---|---|---|---|
"""
        + "\n".join(rows)
        + "\n"
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
