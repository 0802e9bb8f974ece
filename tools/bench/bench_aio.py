"""Sequential read/write throughput of zero_ops AsyncIOHandle vs `dd` and `fio` on the same file system.

Usage: python tools/bench/bench_aio.py [--mib 256] [--dir /tmp] [--threads 1 2] [--reps 3]
Like for like, in one run, on one file:
  * direct: dd oflag=direct / iflag=direct, fio --direct=1 (libaio, iodepth 8), zero_ops with
    O_DIRECT on page-aligned buffers;
  * buffered: dd without direct flags, zero_ops with o_direct=False (reads then come from the
    page cache for both, the file having just been written).
Every write is followed by an fsync-equivalent (dd conv=fdatasync, fio --end_fsync=1, os.fsync)
so all sides include getting the data to the device. zero_ops runs on each backend it has here
(libaio, threads).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import time

import torch
from zero_ops import _native, op_report
from zero_ops.aio import AsyncIOHandle


def dd(args: list[str]) -> float:
    proc = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = re.search(r"copied, ([0-9.]+) s", proc.stderr)
    return float(m.group(1))


def fio(path: str, rw: str, mib: int) -> float:
    """Seconds fio takes to move `mib` MiB sequentially with O_DIRECT, libaio, iodepth 8, bs 1M."""
    cmd = [
        "fio", "--name=seq", f"--filename={path}", f"--rw={rw}", "--bs=1M", f"--size={mib}M",
        "--direct=1", "--ioengine=libaio", "--iodepth=8", "--output-format=json",
    ]  # fmt: skip
    if rw == "write":
        cmd.append("--end_fsync=1")
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    job = out["jobs"][0]["write" if rw == "write" else "read"]
    return (mib << 20) / (job["bw_bytes"])


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_aio.md"))
    args = ap.parse_args()
    nbytes = args.mib << 20
    path = os.path.join(args.dir, f"zero_ops_bench_{os.getpid()}.bin")
    results: dict[str, list[float]] = {}
    C = _native.native()
    backends = ["threads"] + (
        ["libaio"] if C is not None and C.libaio_compiled() and not C.libaio_probe() else []
    )
    have_fio = shutil.which("fio") is not None
    handles = {}
    for b in backends:
        for t in args.threads:
            for direct in (True, False):
                handles[(b, t, direct)] = AsyncIOHandle(
                    block_size=1 << 20, queue_depth=8, thread_count=t, o_direct=direct, engine=b
                )
    buf = next(iter(handles.values())).new_cpu_locked_tensor(nbytes // 4, torch.float32)
    buf.fill_(1.0)

    def add(name: str, seconds: float) -> None:
        results.setdefault(name, []).append(seconds)

    try:
        for _ in range(args.reps):  # round-robin: every variant once per round
            count = f"count={args.mib}"
            add("write direct: dd bs=1M oflag=direct conv=fdatasync",
                dd(["if=/dev/zero", f"of={path}", "bs=1M", count, "oflag=direct", "conv=fdatasync"]))  # fmt: skip
            add(
                "read direct: dd bs=1M iflag=direct",
                dd([f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"]),
            )
            add("write buffered: dd bs=1M conv=fdatasync",
                dd(["if=/dev/zero", f"of={path}", "bs=1M", count, "conv=fdatasync"]))  # fmt: skip
            add("read buffered: dd bs=1M", dd([f"if={path}", "of=/dev/null", "bs=1M"]))
            if have_fio:
                add("write direct: fio libaio iodepth=8 bs=1M (+fsync)", fio(path, "write", args.mib))
                add("read direct: fio libaio iodepth=8 bs=1M", fio(path, "read", args.mib))
            for (b, t, direct), h in handles.items():
                mode = "direct" if direct else "buffered"
                os.unlink(path)
                t0 = time.perf_counter()
                h.async_pwrite(buf, path)
                h.wait()
                _fsync(path)
                add(f"write {mode}: zero_ops {b}, {t} thread(s), qd 8 (+fsync)", time.perf_counter() - t0)
                t0 = time.perf_counter()
                h.async_pread(buf, path)
                h.wait()
                add(f"read {mode}: zero_ops {b}, {t} thread(s), qd 8", time.perf_counter() - t0)
            assert all(h.direct_bytes() > 0 for (_, _, d), h in handles.items() if d)
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
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "packages/zero-ops", "tools/bench"],
            capture_output=True,
            text=True,
            cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."),
        ).stdout.strip()
        if dirty and commit != "uncommitted":
            commit += " + uncommitted changes to packages/zero-ops / tools/bench"
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

    def base(name: str) -> float:
        direction, mode = name.split(":")[0].split()
        flag = "oflag" if direction == "write" else "iflag"
        key = next(k for k in results if k.startswith(f"{direction} {mode}: dd"))
        assert mode == "buffered" or flag in key
        return statistics.median(results[key])

    lines = [
        "# Async I/O sequential throughput",
        "",
        f"- machine: nproc={os.cpu_count()}, CPU: {cpu}, {platform.machine()}; file system of {args.dir}: {fs}",
        f"- torch {torch.__version__}, git commit {commit}; zero_ops: {op_report()[-1]}",
        f"- fio: {subprocess.run(['fio', '--version'], capture_output=True, text=True).stdout.strip() if have_fio else 'not installed'}",
        f"- load average at start of the report: {os.getloadavg()}",
        f"- command: `python tools/bench/bench_aio.py --mib {args.mib} --dir {args.dir} --threads "
        f"{' '.join(map(str, args.threads))} --reps {args.reps}`",
        f"- file size {args.mib} MiB; median of {args.reps} rounds (spread min..max), variants round-robin;",
        "  'vs dd' = dd's median time / this row's median time, same direction and mode (direct or buffered)",
        "",
        "| variant | median s | spread s | MB/s | vs dd |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(results, key=lambda k: (k.split(":")[0], "zero_ops" in k, k)):
        ts = results[name]
        med = statistics.median(ts)
        lines.append(
            f"| {name} | {med:.3f} | {min(ts):.3f}..{max(ts):.3f} | {nbytes / med / 1e6:.0f} | "
            f"{base(name) / med:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
