"""Profiling overhead and FLOP-count accuracy on a GPT forward: zero-profiler vs the others.

Compares, in one process, a plain forward against the same forward under zero_profiler's
FlopsProfiler, DeepSpeed's FlopsProfiler, torch.utils.flop_counter.FlopCounterMode, fvcore and
ptflops (whichever import), and each tool's FLOP count against the analytic truth.

Two model sizes: "small" (the part-1 GPT, ~10^2 ms per forward: compute dominates, overheads are
near 1.0) and "tiny" (~1 ms per forward: the per-operator Python cost of each tool dominates).
Two ways to time a tool: "session" (start + one forward + stop, what get_model_profile does) and
"steady" (one forward while the tool is already running, what a profiled training step sees).

Times are CPU time of the benchmark thread (time.thread_time, OMP_NUM_THREADS=1 so all the work
runs in that thread): on a 2-core machine shared with other jobs (load average above 10), wall
time mostly measures how long the thread waited for a core. Timing is also paired: every rep runs
plain, tool, plain, tool, ... (ABAB) and each tool's time is divided by the plain forward just
before it, so slower drifts (cache pressure from other jobs) cancel; the table reports the median
of those paired ratios and their interquartile range. Reps go round-robin over the tools (rep 1
of every tool, then rep 2 ...), so no tool is measured in a quieter stretch than another.

"Floors" rows: the steady overhead of an empty TorchDispatchMode and an empty TorchFunctionMode
(each just runs the function), measured the same way: what any profiler built on that mechanism
pays before counting anything.

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
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from bench_env import cpu_model, git_commit
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

clock = time.thread_time  # see the module docstring

CONFIGS = {
    # name: (batch, seq, hidden, heads, layers, vocab)
    "small": (4, 128, 256, 8, 4, 8192),
    "tiny": (1, 16, 32, 4, 4, 256),
}


class Block(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, t, c, h, layers, vocab):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, c), nn.Embedding(t, c)
        self.blocks = nn.ModuleList(Block(c, h) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)
        self.head = nn.Linear(c, vocab, bias=False)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def analytic(b, t, c, h, layers, vocab):
    """(matmul-only FLOPs = 2 * MACs, full FLOPs under zero-profiler's conventions)."""
    bt, hd = b * t, c // h
    mm = layers * (2 * bt * c * 3 * c + 2 * bt * c * c + 2 * bt * c * 4 * c * 2) + 2 * bt * c * vocab
    attn_mm = layers * 2 * b * h * t * t * 2 * hd
    softmax = layers * b * h * t * t
    elementwise = bt * c + layers * (5 * bt * c * 2 + bt * c * 2 + bt * 4 * c) + 5 * bt * c
    return mm + attn_mm, mm + attn_mm + softmax + elementwise


class EmptyDispatchMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls):
        return False  # no torch._disable_dynamo wrapper: the cheapest dispatch mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class EmptyFunctionMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def floor_starts():
    """name -> start() returning stop(), for the empty modes (steady rows only)."""

    def entering(mode_cls):
        def start():
            mode = mode_cls()
            mode.__enter__()
            return lambda: mode.__exit__(None, None, None)

        return start

    return {
        "empty TorchDispatchMode (floor)": entering(EmptyDispatchMode),
        "empty TorchFunctionMode (floor)": entering(EmptyFunctionMode),
    }


def make_tools(model, ids, plain, quiet):
    """name -> (session callable returning FLOPs, steady (start, stop) or None)."""
    tools = {}
    from zero_profiler import FlopsProfiler as ZeroProfiler

    def zero_run():
        p = ZeroProfiler(model)
        p.start_profile()
        plain()
        p.stop_profile()
        f = p.get_total_flops()
        p.end_profile()
        return f

    def zero_steady():
        p = ZeroProfiler(model)
        p.start_profile()
        return p.end_profile

    tools["zero-profiler"] = (zero_run, zero_steady)
    try:
        import deepspeed
        from deepspeed.profiling.flops_profiler import FlopsProfiler as DSProfiler

        def ds_run():
            p = DSProfiler(model)
            p.start_profile()
            plain()
            p.stop_profile()
            f = p.get_total_flops()
            p.end_profile()
            return f

        def ds_steady():
            p = DSProfiler(model)
            p.start_profile()
            return p.end_profile

        tools[f"deepspeed {deepspeed.__version__}"] = (ds_run, ds_steady)
    except ImportError as err:
        print("deepspeed unavailable:", err)
    from torch.utils.flop_counter import FlopCounterMode

    def fc_run():
        with FlopCounterMode(display=False) as fc:
            plain()
        return fc.get_total_flops()

    def fc_steady():
        fc = FlopCounterMode(display=False)
        fc.__enter__()
        return lambda: fc.__exit__(None, None, None)

    tools["torch FlopCounterMode"] = (fc_run, fc_steady)
    try:
        from fvcore.nn import FlopCountAnalysis

        def fv_run():
            with quiet:
                a = FlopCountAnalysis(model, ids)
                a.unsupported_ops_warnings(False)
                a.uncalled_modules_warnings(False)
                return 2 * a.total()  # fvcore counts one MAC as one "flop"

        tools["fvcore (x2: counts MACs)"] = (fv_run, None)
    except ImportError as err:
        print("fvcore unavailable:", err)
    try:
        from ptflops import get_model_complexity_info

        def pt_run():
            with quiet:
                macs, _ = get_model_complexity_info(
                    model, tuple(ids.shape), input_constructor=lambda _: {"ids": ids}, as_strings=False,
                    print_per_layer_stat=False, verbose=False, backend="pytorch",
                )  # fmt: skip
            return 2 * macs

        tools["ptflops (x2: counts MACs)"] = (pt_run, None)
    except ImportError as err:
        print("ptflops unavailable:", err)
    return tools


def quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def bench_config(name, reps, quiet):
    b, t, c, h, layers, vocab = CONFIGS[name]
    torch.manual_seed(0)
    model = GPT(t, c, h, layers, vocab).eval()
    ids = torch.randint(0, vocab, (b, t))

    def plain():
        with torch.no_grad():
            model(ids)

    tools = make_tools(model, ids, plain, quiet)
    for fn, _ in tools.values():  # warm up every path once
        with quiet:
            fn()
    plain()
    plain_times, counts = [], {}
    session = {n: ([], []) for n in tools}  # name -> (times, paired ratios)
    for _ in range(reps):
        for tool, (fn, _) in tools.items():
            t0 = clock()
            plain()
            t1 = clock()
            with quiet:
                counts[tool] = fn()
            t2 = clock()
            plain_times.append(t1 - t0)
            session[tool][0].append(t2 - t1)
            session[tool][1].append((t2 - t1) / (t1 - t0))
    # Steady state: the tool is running; alternate a forward outside it with one inside it.
    starts = {tool: start for tool, (_, start) in tools.items() if start is not None}
    starts.update(floor_starts())
    for start in starts.values():  # warm up
        stop = start()
        plain()
        stop()
    steady = {tool: ([], []) for tool in starts}
    for _ in range(reps):
        for tool, start in starts.items():
            t0 = clock()
            plain()
            t1 = clock()
            stop = start()
            t2 = clock()
            plain()
            t3 = clock()
            stop()
            steady[tool][0].append(t3 - t2)
            steady[tool][1].append((t3 - t2) / (t1 - t0))
    return dict(
        shape=(b, t, c, h, layers, vocab),
        truth=analytic(b, t, c, h, layers, vocab),
        plain=plain_times,
        session=session,
        steady=steady,
        counts=counts,
    )


def table(res):
    mm_truth, full_truth = res["truth"]
    plain = res["plain"]
    lo, hi = quartiles(plain)
    rows = [
        "| tool | session median ms | session ratio (IQR) | steady median ms | steady ratio (IQR) "
        "| FLOPs counted | error vs full / matmul-only |",
        "|---|---|---|---|---|---|---|",
        f"| plain | {statistics.median(plain) * 1e3:.2f} (IQR {lo * 1e3:.2f}-{hi * 1e3:.2f}) | 1.000 | | | | |",
    ]
    for tool, (times, ratios) in res["session"].items():
        q1, q3 = quartiles(ratios)
        s_cell = f"{statistics.median(times) * 1e3:.2f} | {statistics.median(ratios):.3f} ({q1:.3f}-{q3:.3f})"
        if tool in res["steady"]:
            st, sr = res["steady"][tool]
            p1, p3 = quartiles(sr)
            st_cell = f"{statistics.median(st) * 1e3:.2f} | {statistics.median(sr):.3f} ({p1:.3f}-{p3:.3f})"
        else:
            st_cell = "n/a | n/a"
        cnt = res["counts"][tool]
        err = f"{100 * (cnt - full_truth) / full_truth:+.2f}% / {100 * (cnt - mm_truth) / mm_truth:+.2f}%"
        rows.append(f"| {tool} | {s_cell} | {st_cell} | {cnt / 1e9:.6f} G | {err} |")
    for tool, (st, sr) in res["steady"].items():
        if tool not in res["session"]:  # the floors: steady rows only
            p1, p3 = quartiles(sr)
            st_cell = f"{statistics.median(st) * 1e3:.2f} | {statistics.median(sr):.3f} ({p1:.3f}-{p3:.3f})"
            rows.append(f"| {tool} | n/a | n/a | {st_cell} | n/a | n/a |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps-small", type=int, default=15)
    ap.add_argument("--reps-tiny", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    quiet = contextlib.redirect_stdout(io.StringIO())
    load_start = " ".join(f"{x:.1f}" for x in os.getloadavg())
    t_start = time.perf_counter()
    results = {
        "small": bench_config("small", args.reps_small, quiet),
        "tiny": bench_config("tiny", args.reps_tiny, quiet),
    }
    elapsed = time.perf_counter() - t_start
    commit = git_commit("packages/zero-profiler", "tools/bench/bench_profiler.py")
    cpu = cpu_model()
    import importlib.metadata as md

    def ver(d):
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            return "not installed"

    load = f"load average at start: {load_start}, at end: " + " ".join(f"{x:.1f}" for x in os.getloadavg())
    parts = [
        f"""# bench_profiler: profiling overhead and FLOP accuracy, GPT forward

Machine: nproc={os.cpu_count()}, {cpu}; Python {platform.python_version()}; torch {torch.__version__};
deepspeed {ver("deepspeed")}; fvcore {ver("fvcore")}; ptflops {ver("ptflops")}; zero-profiler {ver("zero-profiler")}.
Git commit: {commit}. OMP_NUM_THREADS={os.environ.get("OMP_NUM_THREADS", "unset")}; {load}; run took {elapsed:.0f} s.
Command: `DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python tools/bench/bench_profiler.py --reps-small {args.reps_small} --reps-tiny {args.reps_tiny} --out tools/bench/results/bench_profiler.md`

fp32, eval, no_grad. "session": start + one forward + stop (fvcore: its JIT trace; ptflops: its hook
setup), as get_model_profile does. "steady": one forward while the tool is already running.
Times are CPU time of the benchmark thread (time.thread_time; wall time on this shared machine
mostly measures waiting for a core). Ratios are paired (each timed run divided by the plain
forward run just before it, ABAB...): median and interquartile range of the ratios. ms columns are
medians of the raw CPU times. Reps go round-robin over the tools. "Floor" rows: the steady
overhead of an empty TorchDispatchMode / TorchFunctionMode (each only runs the function), what a
profiler built on that mechanism pays before counting anything.
"""
    ]
    for name, res in results.items():
        b, t, c, h, layers, vocab = res["shape"]
        mm_truth, full_truth = res["truth"]
        reps = args.reps_small if name == "small" else args.reps_tiny
        parts.append(
            f"""
## {name}: batch {b} x seq {t}, hidden {c}, {h} heads, {layers} layers, vocab {vocab}; {reps} paired reps

Analytic truth: matmul-only {mm_truth / 1e9:.6f} G (2 x MACs of every product, attention's QK^T and PV
included); full {full_truth / 1e9:.6f} G (plus softmax, layer norms, GELU and adds under zero-profiler's
conventions).

{table(res)}
"""
        )
    text = "".join(parts)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
