#!/usr/bin/env python
"""Checkpoint checksum speed: per-piece CRC-32C (format 3) vs the old sum64 (format 2), zlib CRC-32, dd.

Usage: ``hatch run python tools/bench/bench_checksum.py [--mib 256] [--reps 5] [--out FILE]``.

Measured side by side in one process on the same buffer / file (see [Note: checkpoint
checksum] in ``zero_core/checkpoint/integrity.py``):

* in memory: MB/s of each checksum over one buffer (one thread);
* save path: ``AtomicWriter`` writing the file with fsync, the checksum overlapped on its
  helper thread as the engine's saver does (``defer_checksum``, stable buffers), vs ``dd``
  writing the same bytes with ``conv=fsync``;
* verify path: ``verify_file`` of the page-cached file (what a load's checksum pass costs),
  vs ``dd`` reading it to ``/dev/null``.

Reports medians and spread (min-max) over ``--reps`` and the ratios; writes a markdown table
with the machine, versions, load average and command to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

import crc32c
import numpy as np
import torch
from zero_core.checkpoint.atomic import AtomicWriter
from zero_core.checkpoint.integrity import Crc32cChunks, Sum64, file_crc32c, file_sum64, verify_file


def _timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _row(name: str, nbytes: int, times: list[float], base: float | None) -> str:
    med = statistics.median(times)
    ratio = f"{base / med:.2f}x" if base else ""
    return (
        f"| {name} | {nbytes / med / 1e6:,.0f} | {nbytes / max(times) / 1e6:,.0f}-{nbytes / min(times) / 1e6:,.0f} "
        f"| {ratio} |"
    )


def _memory_rows(buf: memoryview, reps: int) -> list[str]:
    def c32c() -> None:
        c = Crc32cChunks()
        c.update(buf)
        c.digest()

    def s64() -> None:
        s = Sum64()
        s.update(buf)
        s.hexdigest()

    runs = {
        "crc32c per 64 MiB (format 3)": c32c,
        "sum64 (format 2)": s64,
        "zlib.crc32": lambda: zlib.crc32(buf),
    }
    times = {k: _timed(f, reps) for k, f in runs.items()}
    base = statistics.median(times["sum64 (format 2)"])
    return [_row(k, len(buf), t, base) for k, t in times.items()]


def _write(path: str, buf: memoryview, *, crc: bool) -> None:
    with AtomicWriter(path, defer_checksum=True, crc32=False, sum64=not crc, crc32c=crc) as w:
        for lo in range(0, len(buf), 64 * 2**20):
            w.write(buf[lo : lo + 64 * 2**20], stable=True)


def _dd(args: list[str]) -> None:
    subprocess.run(["dd", *args], check=True, capture_output=True)


def _io_rows(buf: memoryview, reps: int, tmp: str) -> list[str]:
    path = os.path.join(tmp, "f.bin")
    src = os.path.join(tmp, "src.bin")
    with open(src, "wb") as f:
        f.write(buf)
    rows = []
    t_dd = _timed(lambda: _dd([f"if={src}", f"of={path}.dd", "bs=16M", "conv=fsync"]), reps)
    t_crc = _timed(lambda: _write(path, buf, crc=True), reps)
    t_sum = _timed(lambda: _write(path, buf, crc=False), reps)
    base = statistics.median(t_sum)
    rows += [
        _row("save: AtomicWriter + crc32c (overlapped)", len(buf), t_crc, base),
        _row("save: AtomicWriter + sum64 (overlapped)", len(buf), t_sum, base),
        _row("save: dd bs=16M conv=fsync", len(buf), t_dd, base),
    ]
    n, crcs = file_crc32c(path)
    rec_c = {"bytes": n, "crc32c": crcs, "crc32c_chunk": 2**26}
    rec_s = {"bytes": n, "sum64": file_sum64(path)[1]}
    t_vc = _timed(lambda: verify_file(path, rec_c), reps)
    t_vs = _timed(lambda: verify_file(path, rec_s), reps)
    t_rd = _timed(lambda: _dd([f"if={path}", "of=/dev/null", "bs=16M"]), reps)
    base = statistics.median(t_vs)
    rows += [
        _row("verify (page cache): crc32c", len(buf), t_vc, base),
        _row("verify (page cache): sum64", len(buf), t_vs, base),
        _row("read (page cache): dd bs=16M", len(buf), t_rd, base),
    ]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    buf = memoryview(np.random.default_rng(0).integers(0, 2**63, size=args.mib * 2**20 // 8).view(np.uint8))
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        rows = ["| what | median MB/s | spread MB/s | vs sum64 (time ratio) |", "|---|---|---|---|"]
        rows += _memory_rows(buf, args.reps) + _io_rows(buf, args.reps, tmp)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    head = [
        "# Checkpoint checksum speed (bench_checksum.py)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; Python "
        f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, crc32c "
        f"{getattr(crc32c, '__version__', '?')} (hardware: {crc32c.hardware_based}); commit {commit}.",
        f"Load average at start {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (shared with other jobs: compare ratios, "
        "not absolute figures).",
        f"Command: `{' '.join([os.path.basename(sys.executable), *sys.argv])}`; {args.mib} MiB, {args.reps} reps, "
        "medians with min-max spread. Ratio column: sum64's median time / this row's (>1 = faster than sum64).",
        "",
    ]
    text = "\n".join(head + rows) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
