"""Sequential read/write throughput of zero_ops AsyncIOHandle vs `dd` on the same file system.

Usage: python tools/bench/bench_aio.py [--mib 512] [--dir /tmp] [--threads 1 2] [--reps 3]
Writes are followed by fsync-equivalent (dd conv=fdatasync / os.fsync) so both sides measure the
device path; reads use O_DIRECT on both sides (dd iflag=direct, aligned buffers here) so the page
cache does not serve them.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import time

import torch
from zero_ops import op_report
from zero_ops.aio import AsyncIOHandle


def dd(args: list[str]) -> float:
    proc = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = re.search(r"copied, ([0-9.]+) s", proc.stderr)
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_aio.md"))
    args = ap.parse_args()
    nbytes = args.mib << 20
    path = os.path.join(args.dir, f"zero_ops_bench_{os.getpid()}.bin")
    results: dict[str, list[float]] = {}
    try:
        for _ in range(args.reps):
            results.setdefault("dd write (bs=1M, conv=fdatasync)", []).append(
                dd(["if=/dev/zero", f"of={path}", "bs=1M", f"count={args.mib}", "conv=fdatasync"])
            )
            results.setdefault("dd read (bs=1M, iflag=direct)", []).append(
                dd([f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])
            )
        for t in args.threads:
            h = AsyncIOHandle(block_size=1 << 20, queue_depth=8, thread_count=t)
            buf = h.new_cpu_locked_tensor(nbytes // 4, torch.float32)
            buf.fill_(1.0)
            for _ in range(args.reps):
                os.unlink(path)
                t0 = time.perf_counter()
                h.async_pwrite(buf, path)
                h.wait()
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
                results.setdefault(f"zero_ops write, {t} thread(s) (+fsync)", []).append(
                    time.perf_counter() - t0
                )
                t0 = time.perf_counter()
                h.async_pread(buf, path)
                h.wait()
                results.setdefault(f"zero_ops read, {t} thread(s) (O_DIRECT)", []).append(
                    time.perf_counter() - t0
                )
            assert h.direct_bytes() > 0
    finally:
        if os.path.exists(path):
            os.unlink(path)
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
    fs = (
        subprocess.run(["df", "-T", args.dir], capture_output=True, text=True)
        .stdout.splitlines()[-1]
        .split()[1]
    )
    dd_w = statistics.median(results["dd write (bs=1M, conv=fdatasync)"])
    dd_r = statistics.median(results["dd read (bs=1M, iflag=direct)"])
    lines = [
        "# Async I/O sequential throughput",
        "",
        f"- machine: nproc={os.cpu_count()}, CPU: {cpu}, {platform.machine()}; file system of {args.dir}: {fs}",
        f"- torch {torch.__version__}, git commit {commit}; zero_ops: {op_report()[-1]}",
        f"- command: `python tools/bench/bench_aio.py --mib {args.mib} --dir {args.dir} --threads "
        f"{' '.join(map(str, args.threads))} --reps {args.reps}`",
        f"- file size {args.mib} MiB; median of {args.reps} (spread min..max); ratio vs dd of the same direction",
        "",
        "| variant | median s | spread s | MB/s | vs dd |",
        "|---|---|---|---|---|",
    ]
    for name, ts in results.items():
        med = statistics.median(ts)
        base = dd_w if "write" in name else dd_r
        lines.append(
            f"| {name} | {med:.3f} | {min(ts):.3f}..{max(ts):.3f} | {nbytes / med / 1e6:.0f} | "
            f"{base / med:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
