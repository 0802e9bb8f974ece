#!/usr/bin/env python
"""Cost of the swap-file checksums (see [Note: swap checksums] in zero_offload/swap_checksums.py).

Usage: ``hatch run python tools/bench/bench_swap_checksum.py [--mib 256] [--reps 5] [--dir DIR] [--out FILE]``.

Measured side by side in one process, interleaved (checksums on, off, on, off ...):

* in memory: GB/s of the CRC-32C over one page-locked 64 MiB buffer (what each swapped byte
  costs once more, on one thread);
* the NVMe optimizer path: one ``StateSwapper.run`` pass (every tile of two optimizer states
  read, verified, updated, checksummed and written back, ``pipeline_read`` and
  ``pipeline_write`` on) over ``--mib`` MiB per state in a folder of ``--dir`` (default: a new
  folder under the working directory, on the local disk), with a light update (one multiply per
  element, so that the swap, not the update, bounds the pass: the checks' largest share) and
  with zero-ops' CPU Adam kernel (what a step does).

Reports medians, spread (min-max) and the overhead of the checks; writes a markdown table with
the machine, versions, load average and command to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ALIGN = 1024


def _crc_speed(reps: int) -> list[float]:
    from zero_offload.swap_checksums import crc32c_of
    from zero_ops.aio import locked_empty

    buf = locked_empty(16 * 2**20, torch.float32)
    buf.uniform_()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        crc32c_of(buf)
        out.append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return out


def _swapper(folder: str, numel: int, tile: int, name: str):  # noqa: ANN202
    from zero_offload.nvme_swapper import BufferPool, StateSwapper
    from zero_offload.swap_files import SwapDirectory
    from zero_ops.aio import AsyncIOHandle

    swap_dir = SwapDirectory(folder, 0 if name == "on" else 1, what="bench_swap_checksum")
    pool = BufferPool(3, tile * 2)
    sw = StateSwapper(
        swap_dir,
        name,
        numel,
        ("exp_avg", "exp_avg_sq"),
        tile_numel=tile,
        pool=pool,
        read_handle=AsyncIOHandle(),
        write_handle=AsyncIOHandle(),
        pipeline_read=True,
        pipeline_write=True,
        fast_init=True,
    )
    return swap_dir, sw


def _updates(tile: int) -> dict:
    from zero_ops.adam import CPUAdam

    param = torch.nn.Parameter(torch.zeros(tile))
    param.grad = torch.randn(tile) * 1e-3
    adam = CPUAdam([param], lr=1e-3)
    adam.step()  # creates its states; the pass swaps these in and out

    def light(lo: int, hi: int, states: dict) -> None:
        for v in states.values():
            v.mul_(0.999).add_(1e-3)

    def cpu_adam(lo: int, hi: int, states: dict) -> None:
        st = adam.state[param]
        n = hi - lo
        st["exp_avg"][:n].copy_(states["exp_avg"])
        st["exp_avg_sq"][:n].copy_(states["exp_avg_sq"])
        adam.step()
        states["exp_avg"].copy_(st["exp_avg"][:n])
        states["exp_avg_sq"].copy_(st["exp_avg_sq"][:n])

    return {"light update": light, "CPU Adam update": cpu_adam}


def _passes(swappers: dict, update, reps: int) -> dict[bool, list[float]]:  # noqa: ANN001
    """Interleaved passes of the swapper with checksums and the one without (same sizes, same folder)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(reps):
        for on in (True, False):
            t0 = time.perf_counter()
            swappers[on].run(update)
            times[on].append(time.perf_counter() - t0)
    return times


def _fmt(xs: list[float], unit: str = "s") -> str:
    return f"{statistics.median(xs):.3f} {unit} ({min(xs):.3f}-{max(xs):.3f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="MiB per optimizer state (two states are swapped)")
    p.add_argument("--tile-mib", type=int, default=16, help="MiB per tile of one state")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default="", help="folder for the swap files (default: a new one under the cwd)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    folder = args.dir or tempfile.mkdtemp(prefix="bench-swap-", dir=os.getcwd())
    numel = args.mib * 2**20 // 4
    tile = args.tile_mib * 2**20 // 4 // ALIGN * ALIGN
    start = time.perf_counter()
    crc = _crc_speed(args.reps * 2)
    print(f"CRC-32C in memory: {_fmt(crc, 'GB/s')}", file=sys.stderr, flush=True)
    made = {on: _swapper(folder, numel, tile, "on" if on else "off") for on in (True, False)}
    swappers = {on: sw for on, (_, sw) in made.items()}
    swappers[False].sums.on = False
    rows = []
    try:
        for sw in swappers.values():
            sw.run(lambda lo, hi, st: None)  # warm-up: the files' blocks written once
        for name, update in _updates(tile).items():
            t = _passes(swappers, update, args.reps)
            moved = 2 * 2 * numel * 4  # read + write of two states
            on, off = statistics.median(t[True]), statistics.median(t[False])
            rows.append((name, t, moved / off / 1e9, on / off - 1))
            print(
                f"{name}: on {_fmt(t[True])}, off {_fmt(t[False])}, overhead {100 * (on / off - 1):+.1f}%",
                file=sys.stderr,
                flush=True,
            )
    finally:
        for swap_dir, _ in made.values():
            swap_dir.close()
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    text = _report(args, crc, rows, time.perf_counter() - start)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def _report(args: argparse.Namespace, crc: list[float], rows: list, seconds: float) -> str:
    import crc32c

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    load = open("/proc/loadavg").read().split()[:3]
    lines = [
        "# Swap-file checksums: cost on the NVMe optimizer path",
        "",
        f"machine: {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), load average {' '.join(load)} "
        "(shared with other jobs: wall times are noisy, the on/off ratio is measured interleaved)",
        "",
        f"torch {torch.__version__}, Python {platform.python_version()}, crc32c hardware: {crc32c.hardware_based}, "
        f"commit {commit}",
        "",
        f"command: python tools/bench/bench_swap_checksum.py --mib {args.mib} --tile-mib {args.tile_mib} "
        f"--reps {args.reps}{' --dir ' + args.dir if args.dir else ''}; wall time {seconds:.0f} s",
        "",
        f"CRC-32C in memory (one thread, page-locked buffer): median {_fmt(crc, 'GB/s')}",
        "",
        f"| pass (2 states x {args.mib} MiB, tiles of {args.tile_mib} MiB) | checksums on | checksums off | swap bandwidth (off) | overhead |",
        "|---|---|---|---|---|",
    ]
    for name, t, bw, over in rows:
        lines.append(f"| {name} | {_fmt(t[True])} | {_fmt(t[False])} | {bw:.2f} GB/s | {100 * over:+.1f}% |")
    lines.append("")
    lines.append(
        "Medians over the repetitions (min-max in brackets); bandwidth counts the bytes read plus written per pass."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
