"""CPU Adam update throughput: zero_ops CPUAdam kernel vs torch.optim.AdamW (default, foreach,
fused), optionally DeepSpeedCPUAdam (when importable), and an in-place axpy roofline, all in one run.

Usage: OMP_NUM_THREADS=1 python tools/bench/bench_cpu_adam.py [--sizes 50e6 200e6] [--threads 1 2]
       [--reps 5] [--out tools/bench/results/bench_cpu_adam.md]
Effective bandwidth counts 28 bytes per fp32 parameter step (read p, g, m, v; write p, m, v).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import torch
from zero_ops import op_report
from zero_ops.adam import cpu_adam_step


def timeit(fn, reps):
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts), max(ts)


def bench(n, threads, reps):
    torch.set_num_threads(threads)
    rows = []
    a, b = torch.randn(n), torch.randn(n)
    rows.append(
        ("axpy roofline a.add_(b, alpha) (12 B/elem)", timeit(lambda: a.add_(b, alpha=1e-9), reps), 12)
    )
    a = b = None  # free the roofline buffers before the optimizer ones
    p, g, m, v = torch.randn(n), torch.randn(n) * 1e-3, torch.zeros(n), torch.zeros(n)
    step = [0]

    def ours():
        step[0] += 1
        cpu_adam_step(
            p,
            g,
            m,
            v,
            step=step[0],
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            threads=threads,
        )

    rows.append(("zero_ops cpu_adam_step fp32", timeit(ours, reps), 28))
    for name, kw in (
        ("torch AdamW fused", {"fused": True}),
        ("torch AdamW foreach", {"foreach": True}),
        ("torch AdamW default", {}),
    ):
        if name.endswith("default") and n > 60e6 and reps > 3:
            r = 3
        else:
            r = reps
        prm = torch.nn.Parameter(p.clone())
        prm.grad = g.clone()
        opt = torch.optim.AdamW([prm], lr=1e-3, weight_decay=0.01, **kw)
        rows.append((name + " fp32", timeit(opt.step, r), 28))
        del opt, prm
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # only in the bench venv

        prm = torch.nn.Parameter(p.clone())
        prm.grad = g.clone()
        ds = DeepSpeedCPUAdam([prm], lr=1e-3, weight_decay=0.01)
        rows.append(("DeepSpeedCPUAdam fp32", timeit(ds.step, reps), 28))
        del ds, prm
    except Exception as exc:  # noqa: BLE001 - report why the baseline is missing
        rows.append((f"DeepSpeedCPUAdam: not available ({type(exc).__name__})", None, 28))
    # bf16 parameters, fp32 master + states: ours writes the bf16 copy in the same pass.
    out = torch.empty(n, dtype=torch.bfloat16)
    gb = g.to(torch.bfloat16)

    def ours_bf16():
        step[0] += 1
        cpu_adam_step(
            p,
            gb,
            m,
            v,
            step=step[0],
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            low_precision_out=out,
            threads=threads,
        )

    rows.append(("zero_ops fused fp32 master + bf16 copy (bf16 grad)", timeit(ours_bf16, reps), None))
    prm = torch.nn.Parameter(p.clone())
    prm.grad = g.clone()
    opt = torch.optim.AdamW([prm], lr=1e-3, weight_decay=0.01, fused=True)

    def torch_bf16():
        prm.grad.copy_(gb)  # widen the bf16 gradient
        opt.step()
        out.copy_(prm.detach())  # separate cast to the bf16 copy

    rows.append(("torch AdamW fused fp32 + grad widen + separate bf16 cast", timeit(torch_bf16, reps), None))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[50e6, 200e6])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_cpu_adam.md"))
    args = ap.parse_args()
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__)
            ).stdout.strip()
            or "uncommitted"
        )
    except OSError:
        commit = "uncommitted"
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    lines = [
        "# CPU Adam update throughput",
        "",
        f"- machine: nproc={os.cpu_count()}, CPU: {cpu}, {platform.machine()}",
        f"- python {platform.python_version()}, torch {torch.__version__}, git commit {commit}",
        f"- zero_ops op: {op_report()[0]}",
        f"- command: `OMP_NUM_THREADS=1 python tools/bench/bench_cpu_adam.py --sizes "
        f"{' '.join(f'{s:g}' for s in args.sizes)} --threads {' '.join(map(str, args.threads))} "
        f"--reps {args.reps}`",
        "- median of reps (spread = min..max); GB/s counts 28 B per fp32 param step (12 B for axpy);",
        "  ratio = time of the axpy roofline scaled to 28 B / time of the row (1.0 = at the roofline)",
        "",
    ]
    for n in args.sizes:
        n = int(n)
        for t in args.threads:
            rows = bench(n, t, args.reps)
            roof = rows[0][1][0] * 28 / 12
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
            fused = next(r[1][0] for r in rows if r[0].startswith("zero_ops fused"))
            sep = next(r[1][0] for r in rows if r[0].startswith("torch AdamW fused fp32 +"))
            lines += [
                "",
                f"bf16-copy case: zero_ops fused is {sep / fused:.2f}x faster than torch fused + cast.",
                "",
            ]
            print("\n".join(lines[-len(rows) - 6 :]), flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
