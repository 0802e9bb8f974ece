"""Sequential read/write throughput of zero_ops AsyncIOHandle vs `dd` and `fio` on the same file system.

Usage: python tools/bench/bench_aio.py [--mib 256] [--dir /tmp] [--threads 1 2] [--reps 9]
Like for like, in one run, on one file, 1 MiB per I/O call for every tool:
  * direct: dd oflag=direct / iflag=direct, fio --direct=1 (libaio, iodepth 8), zero_ops with
    O_DIRECT on page-aligned buffers;
  * buffered, cold: before every buffered-read repetition the file is evicted from the page cache
    with posix_fadvise(POSIX_FADV_DONTNEED) (this file only; the run checks with `fincore` that
    nothing stayed resident), so dd and zero_ops both read from the device through readahead;
  * buffered, hot: the whole file is in the page cache (and was read twice, untimed, before the
    hot variants of a round run: see [hot reads]), so a read is a memory copy.
[footprint] What a read row measures depends on where the bytes land. dd (bs=1M, of=/dev/null)
reads every 1 MiB into the same 1 MiB buffer, which stays in the CPU cache; zero_ops reads into
a resident 256 MiB tensor, i.e. writes 256 MiB of memory, as a real swap-in must. Whenever the
source is memory (hot page cache, or a virtual disk served from the host's cache), that
destination traffic dominates. Two extra rows per read mode separate the effects:
  * "pread loop into the tensor": dd's pattern (one blocking 1 MiB preadv per call, no engine)
    into the tensor's memory; 'vs pread loop' = what the engine does with the same destination;
  * "zero_ops ..., 1 MiB tensor reused by 1 MiB requests (dd's footprint)": zero_ops with dd's
    destination footprint (one request of one block at a time, so no queue depth either).
A buffered read with 2 threads copies with 2 CPUs; a direct read's copy, on a virtual disk, is
done by the host.
Every write is followed by an fsync-equivalent (dd conv=fdatasync, fio --end_fsync=1, os.fsync)
so all sides include getting the data to the device. zero_ops runs on each backend it has here
(libaio, threads). Each round runs every variant once, in phases (writes, direct reads, cold
reads, hot reads; see [phases]); the order within a phase rotates between rounds.
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
from bench_env import cpu_model, git_commit
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
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--hot-repeat", type=int, default=5, help="hot-read samples per variant and round")
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
    # One block per pread: how the threads backend moved O_DIRECT reads before [Note: runs of
    # blocks] (csrc/aio_engine.h), kept as a same-run reference for that change.
    per_block = AsyncIOHandle(
        block_size=1 << 20, queue_depth=8, single_submit=True, thread_count=1, o_direct=True, engine="threads"
    )
    buf = next(iter(handles.values())).new_cpu_locked_tensor(nbytes // 4, torch.float32)
    buf.fill_(1.0)

    def add(name: str, seconds: float) -> None:
        results.setdefault(name, []).append(seconds)

    def evict() -> None:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    evicted_check: list[str] = []

    def check_evicted() -> None:
        if not evicted_check and shutil.which("fincore"):
            out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", path], capture_output=True, text=True)
            evicted_check.append(f"{out.stdout.strip() or '?'} bytes resident after eviction (fincore)")

    def zero_ops_read(h: AsyncIOHandle) -> float:
        t0 = time.perf_counter()
        h.async_pread(buf, path)
        h.wait()
        return time.perf_counter() - t0

    small = next(iter(handles.values())).new_cpu_locked_tensor(1 << 20, torch.uint8)
    small.fill_(1)

    def footprint_read(h: AsyncIOHandle) -> float:
        """dd's pattern and footprint through zero_ops: 1 MiB requests, one at a time, all into one
        reused 1 MiB tensor (the data is discarded, as dd's goes to /dev/null). See [footprint]."""
        t0 = time.perf_counter()
        for off in range(0, nbytes, 1 << 20):
            h.async_pread(small, path, off)
            h.wait()
        return time.perf_counter() - t0

    def pread_loop(direct: bool = False) -> float:
        """dd's pattern into the tensor: one blocking 1 MiB preadv per call, no engine."""
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        view = memoryview(buf.numpy()).cast("B")
        t0 = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.preadv(fd, [view[done : done + (1 << 20)]], done)
        seconds = time.perf_counter() - t0
        os.close(fd)
        return seconds

    count = f"count={args.mib}"
    dd_read = [f"if={path}", "of=/dev/null", "bs=1M"]

    # [phases] A round runs four phases, each variant once per phase in an order that rotates
    # between rounds: writes, then direct reads, cold buffered reads and hot buffered reads of the
    # file the last writer left. Reading right after one's own write + fsync measured 0.51-0.59 of
    # dd for direct reads that reach 1.2-1.4 of dd on a settled file (the device is still busy
    # with the write), so no read variant follows its own write.
    def zero_ops_write(key: tuple[str, int, bool]) -> None:
        b, t, direct = key
        if os.path.exists(path):
            os.unlink(path)
        t0 = time.perf_counter()
        handles[key].async_pwrite(buf, path)
        handles[key].wait()
        _fsync(path)
        mode = "direct" if direct else "buffered"
        add(f"write {mode}: zero_ops {b}, {t} thread(s), qd 8 (+fsync)", time.perf_counter() - t0)

    def zero_ops_row(key: tuple[str, int, bool]) -> str:
        return f"zero_ops {key[0]}, {key[1]} thread(s), qd 8"

    writes = [
        lambda: add("write direct: dd bs=1M oflag=direct conv=fdatasync",
                    dd(["if=/dev/zero", f"of={path}", "bs=1M", count, "oflag=direct", "conv=fdatasync"])),
        lambda: add("write buffered: dd bs=1M conv=fdatasync",
                    dd(["if=/dev/zero", f"of={path}", "bs=1M", count, "conv=fdatasync"])),
    ]  # fmt: skip
    if have_fio:
        writes.append(
            lambda: add("write direct: fio libaio iodepth=8 bs=1M (+fsync)", fio(path, "write", args.mib))
        )
    writes += [lambda k=k: zero_ops_write(k) for k in handles]

    direct_reads = [lambda: add("read direct: dd bs=1M iflag=direct", dd([*dd_read, "iflag=direct"]))]
    if have_fio:
        direct_reads.append(
            lambda: add("read direct: fio libaio iodepth=8 bs=1M", fio(path, "read", args.mib))
        )
    footprint_row = "1 thread(s), 1 MiB tensor reused by 1 MiB requests (dd's footprint)"
    single = [k for k in handles if k[1] == 1]
    direct_reads += [
        lambda: add("read direct: pread loop into the tensor, O_DIRECT, 1 MiB per call", pread_loop(True)),
        lambda: add(
            "read direct: zero_ops threads, 1 thread(s), single_submit (1 MiB per pread)",
            zero_ops_read(per_block),
        ),
    ]
    direct_reads += [
        lambda k=k: add(f"read direct: zero_ops {k[0]}, {footprint_row}", footprint_read(handles[k]))
        for k in single
        if k[2]
    ]
    direct_reads += [
        lambda k=k: add(f"read direct: {zero_ops_row(k)}", zero_ops_read(handles[k])) for k in handles if k[2]
    ]

    def cold(name: str, fn) -> None:
        evict()
        check_evicted()
        add(f"read buffered cold: {name}", fn())

    cold_reads = [lambda: cold("dd bs=1M", lambda: dd(dd_read))]
    cold_reads += [lambda: cold("pread loop into the tensor, 1 MiB per call", pread_loop)]
    cold_reads += [
        lambda k=k: cold(f"zero_ops {k[0]}, {footprint_row}", lambda: footprint_read(handles[k]))
        for k in single
        if not k[2]
    ]
    cold_reads += [
        lambda k=k: cold(zero_ops_row(k), lambda: zero_ops_read(handles[k])) for k in handles if not k[2]
    ]

    # [hot reads] The first two reads of a page after it enters the page cache are slower than
    # later ones (the second one moves it to the active LRU list): measured 0.0074 s vs 0.0023 s
    # for dd on 32 MiB. So the hot phase first reads the file twice, untimed, and then times
    # every hot variant on the same, settled page cache.
    hot_reads = [
        lambda: add("read buffered hot: dd bs=1M", dd(dd_read)),
        lambda: add("read buffered hot: pread loop into the tensor, 1 MiB per call", pread_loop()),
        lambda: add(
            f"read buffered hot: dd bs={args.mib}M count=1 (one read into a fresh buffer of the tensor's size)",
            dd([*dd_read, f"bs={args.mib}M", "count=1"]),
        ),
    ]
    hot_reads += [
        lambda k=k: add(f"read buffered hot: zero_ops {k[0]}, {footprint_row}", footprint_read(handles[k]))
        for k in single
        if not k[2]
    ]
    hot_reads += [
        lambda k=k: add(f"read buffered hot: {zero_ops_row(k)}", zero_ops_read(handles[k]))
        for k in handles
        if not k[2]
    ]

    load_start = os.getloadavg()
    try:
        for rnd in range(args.reps):  # See [phases].
            for phase in (writes, direct_reads, cold_reads, hot_reads):
                if os.path.exists(path):
                    _fsync(path)  # nothing of the last write left to flush during the next phase
                if phase is hot_reads:
                    for _ in range(2):
                        dd(dd_read)  # See [hot reads].
                # Hot reads take ~0.05 s each, short enough for one preemption on this shared
                # machine to double a sample: take several per round (See [hot reads]).
                for rep in range(args.hot_repeat if phase is hot_reads else 1):
                    shift = (rnd + rep) % len(phase)
                    for run in phase[shift:] + phase[:shift]:
                        run()
            assert all(h.direct_bytes() > 0 for (_, _, d), h in handles.items() if d)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    load_end = os.getloadavg()
    commit = git_commit("packages/zero-ops", "tools/bench")
    cpu = cpu_model()
    fs = (
        subprocess.run(["df", "-T", args.dir], capture_output=True, text=True)
        .stdout.splitlines()[-1]
        .split()[1]
    )

    def base_key(name: str) -> str:
        prefix = name.split(":")[0]  # e.g. "read buffered cold": dd's row of the same kind
        return next(k for k in results if k.startswith(f"{prefix}: dd bs=1M"))

    def base(name: str) -> float:
        return statistics.median(results[base_key(name)])

    def paired(name: str) -> str:
        # Sample i of every variant comes from the same round (and hot repetition) as dd's
        # sample i, so the per-round ratio cancels load that lasts longer than a round.
        ratios = [d / t for d, t in zip(results[base_key(name)], results[name])]
        return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})"

    def vs_floor(name: str, med: float) -> str:
        prefix = name.split(":")[0]
        key = next((k for k in results if k.startswith(prefix) and "pread loop" in k), None)
        return f"{statistics.median(results[key]) / med:.2f}" if key else ""

    lines = [
        "# Async I/O sequential throughput",
        "",
        f"- machine: nproc={os.cpu_count()}, CPU: {cpu}, {platform.machine()}; file system of {args.dir}: {fs}",
        f"- torch {torch.__version__}, git commit {commit}; zero_ops: {op_report()[-1]}",
        f"- fio: {subprocess.run(['fio', '--version'], capture_output=True, text=True).stdout.strip() if have_fio else 'not installed'}",
        f"- load average (1, 5, 15 min) at start: {tuple(round(x, 2) for x in load_start)}, "
        f"at end: {tuple(round(x, 2) for x in load_end)}",
        f"- page-cache eviction check: {evicted_check[0] if evicted_check else 'fincore not installed'}",
        f"- command: `python tools/bench/bench_aio.py --mib {args.mib} --dir {args.dir} --threads "
        f"{' '.join(map(str, args.threads))} --reps {args.reps} --hot-repeat {args.hot_repeat}`",
        f"- file size {args.mib} MiB; median of {args.reps} rounds ({args.reps * args.hot_repeat} samples for "
        "hot reads), spread min..max; variants round-robin in phases;",
        "  'vs dd' = dd's median time / this row's median time, same direction and mode (direct, "
        "buffered cold, buffered hot)",
        "  'vs pread loop' (reads) = the median time of the same mode's pread loop into the tensor / this row's",
        "  'vs dd, paired' = median (min..max) over rounds of dd's time / this row's time in the same round",
        "",
        "| variant | median s | spread s | MB/s | vs dd | vs dd, paired | vs pread loop |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in sorted(results, key=lambda k: (k.split(":")[0], "zero_ops" in k, "footprint" not in k, k)):
        ts = results[name]
        med = statistics.median(ts)
        lines.append(
            f"| {name} | {med:.3f} | {min(ts):.3f}..{max(ts):.3f} | {nbytes / med / 1e6:.0f} | "
            f"{base(name) / med:.2f} | {paired(name)} | {vs_floor(name, med)} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
