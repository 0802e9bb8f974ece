"""CPU Adam update throughput: zero_ops CPUAdam kernel vs torch.optim.AdamW (default, foreach,
fused), optionally DeepSpeedCPUAdam (when importable), and an in-place axpy roofline, all in one run.

Run it with DeepSpeed available (see tools/bench/results/bench_cpu_adam.md for the venv) so all
baselines share one process:
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 /tmp/dsvenv/bin/python tools/bench/bench_cpu_adam.py [--sizes 50e6 200e6] [--threads 1 2]
       [--reps 5] [--out tools/bench/results/bench_cpu_adam.md]
Effective bandwidth counts 28 bytes per fp32 parameter step (read p, g, m, v; write p, m, v).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from bench_env import cpu_model, git_commit
from zero_ops import op_report
from zero_ops.adam import cpu_adam_step


def interleaved(fns, reps):
    """Times every variant once per round, round after round, so that the machine's noise (it is
    shared) hits all of them alike; returns {name: (median, min, max)} in seconds."""
    for f in fns.values():
        f()  # warm-up (first-touch of states, JIT of DeepSpeed's op)
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}


def _adam_kw(step):
    return dict(step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _deepspeed_adam():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # only in the bench venv

        return DeepSpeedCPUAdam, ""
    except Exception as exc:  # noqa: BLE001 - report why the baseline is missing
        return None, f"{type(exc).__name__}: {exc}"[:80]


def bench_fp32(n, threads, reps):
    """fp32 params/grads/states: axpy roofline, ours, torch fused, DeepSpeedCPUAdam (interleaved);
    then torch foreach/default (slow, fewer rounds). All share one p and g to save memory."""
    torch.set_num_threads(threads)
    p, g = torch.randn(n), torch.randn(n) * 1e-3
    m, v = torch.zeros(n), torch.zeros(n)
    step = [0]

    def ours():
        step[0] += 1
        cpu_adam_step(p, g, m, v, **_adam_kw(step[0]), threads=threads)

    prm = torch.nn.Parameter(p)  # shares p's storage
    prm.grad = g
    fused = torch.optim.AdamW([prm], lr=1e-3, weight_decay=0.01, fused=True)
    fns = {
        "axpy roofline p.add_(g, alpha) (12 B/elem)": lambda: p.add_(g, alpha=1e-9),
        "zero_ops cpu_adam_step fp32": ours,
        "torch AdamW fused fp32": fused.step,
    }
    DS, why = _deepspeed_adam()
    if DS is not None:
        fns["DeepSpeedCPUAdam fp32"] = DS([prm], lr=1e-3, weight_decay=0.01).step
    res = interleaved(fns, reps)
    rows = [(k, res[k], 12 if k.startswith("axpy") else 28) for k in fns]
    if DS is None:
        rows.append((f"DeepSpeedCPUAdam: not available ({why})", None, 28))
    del fns, fused
    for name, kw in (
        ("torch AdamW foreach fp32", {"foreach": True}),
        ("torch AdamW default fp32", {"foreach": False}),
    ):
        opt = torch.optim.AdamW([prm], lr=1e-3, weight_decay=0.01, **kw)
        rows.append((name, interleaved({name: opt.step}, max(2, reps // 3))[name], 28))
        del opt
    return rows


def bench_bf16(n, threads, reps):
    """bf16 model parameters (what the device holds) with fp32 master + states on the CPU."""
    torch.set_num_threads(threads)
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    gb = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    step = [0]

    def ours():
        step[0] += 1
        cpu_adam_step(p, gb, m, v, **_adam_kw(step[0]), low_precision_out=out, threads=threads)

    prm = torch.nn.Parameter(p.clone())
    prm.grad = torch.empty(n)
    fused = torch.optim.AdamW([prm], lr=1e-3, weight_decay=0.01, fused=True)

    def torch_cast():
        prm.grad.copy_(gb)  # widen the bf16 gradient
        fused.step()
        out.copy_(prm.detach())  # separate cast to the bf16 copy

    fns = {
        "zero_ops fused: fp32 master + bf16 copy (bf16 grad)": ours,
        "torch AdamW fused fp32 + grad widen + separate bf16 cast": torch_cast,
    }
    pb = torch.nn.Parameter(p.to(torch.bfloat16))
    pb.grad = gb
    fns["torch AdamW fused on bf16 params (bf16 states, no fp32 master)"] = torch.optim.AdamW(
        [pb], lr=1e-3, weight_decay=0.01, fused=True
    ).step
    DS, why = _deepspeed_adam()
    if DS is not None:
        pd = torch.nn.Parameter(p.to(torch.bfloat16))
        pd.grad = gb
        fns["DeepSpeedCPUAdam on bf16 params (fp32 states, no fp32 master)"] = DS(
            [pd], lr=1e-3, weight_decay=0.01
        ).step
    res = interleaved(fns, reps)
    rows = [(k, res[k], None) for k in fns]
    if DS is None:
        rows.append((f"DeepSpeedCPUAdam: not available ({why})", None, None))
    return rows


def _ds_version():
    try:
        import deepspeed

        return f"deepspeed {deepspeed.__version__}"
    except Exception as exc:  # noqa: BLE001
        return f"not importable ({type(exc).__name__})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[50e6, 200e6])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_cpu_adam.md"))
    args = ap.parse_args()
    commit = git_commit("packages/zero-ops", "tools/bench")
    cpu = cpu_model()
    lines = [
        "# CPU Adam update throughput",
        "",
        f"- machine: nproc={os.cpu_count()}, CPU: {cpu}, {platform.machine()}",
        f"- python {platform.python_version()}, torch {torch.__version__}, git commit {commit}",
        f"- zero_ops op: {op_report()[0]}",
        f"- DeepSpeed: {_ds_version()}",
        f"- load average at start: {os.getloadavg()}",
        f"- command: `DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 {sys.executable} tools/bench/bench_cpu_adam.py --sizes "
        f"{' '.join(f'{s:g}' for s in args.sizes)} --threads {' '.join(map(str, args.threads))} "
        f"--reps {args.reps}`",
        "- variants of one table are timed round-robin (one call each per round) so noise hits all alike;",
        "- median of reps (spread = min..max); GB/s counts 28 B per fp32 param step (12 B for axpy);",
        "  ratio = time of the axpy roofline scaled to 28 B / time of the row (1.0 = at the roofline)",
        "",
    ]
    for n in args.sizes:
        n = int(n)
        for t in args.threads:
            rows = bench_fp32(n, t, args.reps)
            roof = rows[0][1][0] * 28 / 12
            rows += bench_bf16(n, t, args.reps)
            lines += [
                f"## {n / 1e6:g}M parameters, {t} thread(s)",
                "",
                "| variant | median ms | spread ms | G params/s | GB/s | vs roofline |",
                "|---|---|---|---|---|---|",
            ]
            for name, res, bytes_per in rows:
                if res is None:
                    lines.append(f"| {name} | - | - | - | - | - |")
                    continue
                med, lo, hi = res
                gbs = f"{n * bytes_per / med / 1e9:.1f}" if bytes_per else "-"
                ratio = (
                    f"{roof / med:.2f}" if bytes_per == 28 else ("1.00 (def.)" if bytes_per == 12 else "-")
                )
                lines.append(
                    f"| {name} | {med * 1e3:.1f} | {lo * 1e3:.1f}..{hi * 1e3:.1f} | {n / med / 1e9:.2f} | "
                    f"{gbs} | {ratio} |"
                )
            get = {r[0]: r[1][0] for r in rows if r[1] is not None}
            ours, fused = get["zero_ops cpu_adam_step fp32"], get["torch AdamW fused fp32"]
            bf = get["zero_ops fused: fp32 master + bf16 copy (bf16 grad)"]
            sep = get["torch AdamW fused fp32 + grad widen + separate bf16 cast"]
            lines += [
                "",
                f"fp32: zero_ops / roofline = {roof / ours:.2f}; zero_ops is {fused / ours:.2f}x torch fused",
            ]
            ds = get.get("DeepSpeedCPUAdam fp32")
            if ds:
                lines[-1] += f", {ds / ours:.2f}x DeepSpeedCPUAdam"
            lines += [f"bf16 copy: zero_ops fused is {sep / bf:.2f}x faster than torch fused + cast.", ""]
            print("\n".join(lines[-len(rows) - 8 :]), flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
