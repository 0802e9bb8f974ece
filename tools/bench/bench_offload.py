"""Benchmark of NVMe optimizer offload: step time and swap throughput vs dd on the same file system.

Model: an MLP whose fp32 optimizer states (master + Adam exp_avg + exp_avg_sq, 12 bytes per
parameter) are 4x larger than the CPU memory the run allows for them (``buffer_count`` x tile
bytes of swap buffers): ZeRO stage 3, offload_optimizer nvme with pipelined reads/writes.
Swap throughput: bytes moved by the optimizer-state swapper per second of step, against
``dd`` writing/reading a file of the same size (oflag/iflag=direct when possible) in the same
run. Usage: python tools/bench/bench_offload.py [--nvme DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn


def _dd(path: str, mib: int) -> tuple[float, float]:
    """(write MB/s, read MB/s) of dd with O_DIRECT on ``path``'s file system."""
    f = os.path.join(path, "dd_probe.bin")

    def run(args: list[str]) -> float:
        out = subprocess.run(args, capture_output=True, text=True, check=True).stderr
        m = re.search(r"([\d.]+) s, ", out)
        return mib * 2**20 / float(m.group(1)) / 1e6

    try:
        w = run(["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync"])
        r = run(["dd", f"if={f}", "of=/dev/null", "bs=1M", "iflag=direct"])
    finally:
        if os.path.exists(f):
            os.remove(f)
    return w, r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvme", default=None, help="directory on the disk to test (default: a temp dir)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--width", type=int, default=1024)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    import zero_core
    from zero_core import comm

    nvme = args.nvme or tempfile.mkdtemp(prefix="bench_offload_")
    torch.manual_seed(0)
    w = args.width
    model = nn.Sequential(*[nn.Linear(w, w) for _ in range(4)])
    n = sum(p.numel() for p in model.parameters())
    state_bytes = 12 * n
    tile = 1 << 18  # sub_group_size (elements)
    buffer_count = 3
    allowed = buffer_count * tile * 2 * 4
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "steps_per_print": 10**6,
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": tile,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme,
                "buffer_count": buffer_count,
                "pipeline_read": True,
                "pipeline_write": True,
            },
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 2},
    }
    engine, *_ = zero_core.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4), config=cfg
    )
    x = torch.randn(8, w)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    opt_times = []
    off = engine.strategy.offload
    for _ in range(3):  # the swapper alone: read+write of every state tile
        for p in engine.strategy.master.values():
            if off.owns(p):
                off.stage_grad(p, torch.zeros_like(p))
        t0 = time.perf_counter()
        off.step(engine.strategy.optimizer)
        opt_times.append(time.perf_counter() - t0)
    bd = engine.memory_breakdown()
    engine.destroy()
    swapped = 2 * 2 * 4 * n  # exp_avg and exp_avg_sq, read and written
    swap_mbs = swapped / statistics.median(opt_times) / 1e6
    mib = max(64, 8 * n * 4 // 2**20)
    dd_w, dd_r = _dd(nvme, mib)
    dd_mbs = 2 / (1 / dd_w + 1 / dd_r)  # same read:write mix as the swapper
    commit = (
        subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        or "uncommitted"
    )
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    lines = [
        "# bench_offload: stage 3 + NVMe optimizer offload",
        "",
        f"- machine: nproc={os.cpu_count()}, CPU {cpu}, {platform.platform()}",
        f"- versions: python {sys.version.split()[0]}, torch {torch.__version__}",
        f"- git commit: {commit} (working tree had uncommitted changes)",
        f"- command: `OMP_NUM_THREADS=1 python tools/bench/bench_offload.py --steps {args.steps} --width {w}`",
        f"- swap dir file system: {nvme}",
        f"- parameters: {n}; fp32 optimizer states (master+exp_avg+exp_avg_sq): {state_bytes / 2**20:.1f} MiB; "
        f"CPU bytes allowed for swapped states (buffer_count x tile): {allowed / 2**20:.1f} MiB "
        f"(ratio {8 * n / allowed:.1f}x for the swapped exp_avg+exp_avg_sq); measured host_swap_buffers "
        f"{bd['host_swap_buffers'] / 2**20:.1f} MiB, host_optimizer_states {bd['host_optimizer_states']}",
        "",
        "| metric | median | min | max |",
        "|---|---|---|---|",
        f"| train step (s), {args.steps} steps | {statistics.median(times):.3f} | {min(times):.3f} | {max(times):.3f} |",
        f"| optimizer step alone (s) | {statistics.median(opt_times):.3f} | {min(opt_times):.3f} | {max(opt_times):.3f} |",
        "",
        "| throughput | MB/s |",
        "|---|---|",
        f"| offload swapper (state bytes read+written / optimizer step time, includes Adam compute) | {swap_mbs:.0f} |",
        f"| dd write O_DIRECT | {dd_w:.0f} |",
        f"| dd read O_DIRECT | {dd_r:.0f} |",
        f"| dd harmonic mix (1:1 read/write) | {dd_mbs:.0f} |",
        f"| ratio swapper / dd mix | {swap_mbs / dd_mbs:.2f} |",
        "",
        "DeepSpeed ZeRO-Infinity comparison: not run (see the report; no number is claimed).",
    ]
    text = "\n".join(lines) + "\n"
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_offload.md")
    with open(out + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(out + ".tmp", out)
    print(text)
    if comm.is_initialized():
        comm.destroy_process_group() if hasattr(comm, "destroy_process_group") else None


if __name__ == "__main__":
    main()
