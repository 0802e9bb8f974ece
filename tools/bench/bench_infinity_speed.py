"""ZeRO-Infinity's speed at the limit: swap throughput against dd, compute hidden, and DeepSpeed.

With parameters and optimizer states on NVMe (stage 3, ``offload_param`` and ``offload_optimizer``
nvme, one JSON config for both systems: [Note: one config for every system] in _gpt_job.py), a
training step of the examples/ GPT on 2 ranks is bound by the disk. Per pass, in this order:

1. ``dd`` with O_DIRECT on the swap folder: a ``--dd-mib`` write (``oflag=direct conv=fsync``),
   then a read of it (``iflag=direct``): the page cache is bypassed, not dropped, so nothing is
   read from memory and nothing of other users' caches is thrown away.
2. one launch (a fresh 2-rank job) per variant, alternating: zero NVMe, DeepSpeed NVMe, zero with
   everything in RAM (stage 3, no offload), and DeepSpeed in RAM where ``--variants`` asks for it
   (off by default: DeepSpeed's stage 3 in RAM peaks at ~2x zero's memory on this model), and
   zero NVMe with zero-offload's host heap bound raised to 32 MiB (``zero-nvme-heap32``: the
   speed a user buys with resident memory, see VARIANT_ENV), and both systems launched with
   PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` (``zero-nvme-thp``, ``deepspeed-nvme-thp``). Each
   runs ``--steps`` steps; the first ``--warmup`` are left out. A launch that fails (over the
   ``--ceiling-gib`` memory ceiling, an error) is reported and left out; the rest go on.

[Note: swap throughput and hidden compute]
Bytes swapped per step: what the ranks' processes read from and wrote to the block layer during
the step (``/proc/PID/io`` read_bytes / write_bytes: with O_DIRECT every swap counts, nothing is
served from the page cache), summed over ranks. For a step that reads R and writes W bytes, the
disk's *mixed bandwidth* is the rate dd's speeds allow for that mix, reads and writes one after
the other: ``B_mix = (R + W) / (R / B_read + W / B_write)`` with B_read and B_write dd's O_DIRECT
bandwidths of the same pass. The swap throughput is ``(R + W) / step time``; the target is at least
0.8 B_mix (the step moves its bytes at 80% of what the disk does for a bare copy).

The swap time alone is ``T_io = R / B_read + W / B_write``: how long the disk needs for the step's
bytes with nothing else running (a lower bound on the swapping's own time). With the step time in
RAM ``T_ram`` (the same model and config without offload) and with swapping ``T_nvme``, the
fraction of the smaller of the two that runs concurrently with the other is
``hidden = (T_ram + T_io - T_nvme) / min(T_ram, T_io)``: 1 when the step takes
``max(T_ram, T_io)`` (the compute entirely under the swapping, or the other way round), 0 when it
takes their sum. Figures per pass; the results quote medians over passes.

Step time against DeepSpeed: per pass, zero's median step over DeepSpeed's (launches alternate,
so the machine's load hits both); the median of the per-pass ratios and its quartiles. Target
<= 0.7x. Each system's swap files are removed after its launch, so the two never share the disk.

Usage: python tools/bench/bench_infinity_speed.py --nvme-dir /path/on/disk [--passes 5] [--layers 8]
(the defaults: 5 passes of 6 launches at 101M parameters, about 4 GB swapped per step against
about two seconds of compute at seq_len 32; about 20 minutes, 11 for --passes 3. Peak memory at
this size: up to ~12 GiB for a launch of either system, under the 16 GiB --ceiling-gib)
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

import _gpt_job as job
from _memwatch import GIB, meminfo, run_job, wait_for_available
from _timing import LoadLog, quartiles
from bench_env import ROOT, cpu_model, git_commit

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {  # name: (system, mode)
    "zero-nvme": ("zero", "stage3+nvme"),
    "deepspeed-nvme": ("deepspeed", "stage3+nvme"),
    "zero-ram": ("zero", "stage3"),
    "deepspeed-ram": ("deepspeed", "stage3"),
    "zero-nvme-heap32": ("zero", "stage3+nvme"),
    "zero-nvme-thp": ("zero", "stage3+nvme"),
    "deepspeed-nvme-thp": ("deepspeed", "stage3+nvme"),
}
#: extra environment of a variant. zero-nvme-heap32: zero-offload's host heap bound raised from
#: 128 KiB to 32 MiB (ZERO_MMAP_THRESHOLD; See [Note: host heap under NVMe offload]): on a machine
#: whose CPU is also the "device", every shard, all-gather buffer and gradient of a few MiB is
#: then served by malloc's heap instead of fresh, page-faulting mmaps, for more resident memory.
#: *-thp: PyTorch's own THP_MEM_ALLOC_ENABLE=1 (CPU tensors of 2 MiB and more advised to use
#: transparent huge pages: one fault per 2 MiB instead of per 4 KiB), for both systems alike. A
#: bare loop of 64 MiB allocations runs 4x faster with it here, but a fault may stall in the
#: kernel's direct compaction (THP defrag "madvise"), so whether a training step gains depends on
#: the host's memory fragmentation: measure it, as these variants do
THP = {"THP_MEM_ALLOC_ENABLE": "1"}
VARIANT_ENV = {
    "zero-nvme-heap32": {"ZERO_MMAP_THRESHOLD": str(32 << 20)},
    "zero-nvme-thp": THP,
    "deepspeed-nvme-thp": THP,
}
#: (numerator, denominator, headline) of the per-pass step-time ratios the results quote
RATIOS = [
    ("zero-nvme", "deepspeed-nvme", "zero / DeepSpeed step time (NVMe), median of per-pass ratios (IQR)"),
    ("zero-nvme-heap32", "deepspeed-nvme", "zero with ZERO_MMAP_THRESHOLD=32 MiB / DeepSpeed (NVMe)"),
    (
        "zero-nvme-thp",
        "deepspeed-nvme-thp",
        "both launched with THP_MEM_ALLOC_ENABLE=1: zero / DeepSpeed (NVMe)",
    ),
]
SWAP_PREFIX = "bench_infinity_speed_"


def dd_bandwidth(folder: str, mib: int) -> tuple[float, float]:
    """(write, read) bytes/s of dd with O_DIRECT in ``folder`` (a ``mib`` MiB file, removed after)."""
    path = os.path.join(folder, f"{SWAP_PREFIX}dd_{os.getpid()}.bin")

    def run(cmd: list[str]) -> float:
        err = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        m = re.search(r"copied, ([\d.]+) s", err)
        if m is None:
            raise RuntimeError(f"cannot read dd's time from: {err!r}")
        return mib * 2**20 / float(m.group(1))

    try:
        w = run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync"])
        r = run(["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])
    finally:
        if os.path.exists(path):
            os.remove(path)
    return w, r


def launch(variant: str, args: argparse.Namespace) -> dict:
    """One 2-rank job of ``variant``: per-step times (slowest rank), bytes, phases, peak RSS."""
    system, mode = VARIANTS[variant]
    swap = os.path.join(args.nvme_dir, f"{SWAP_PREFIX}{os.getpid()}") if mode == "stage3+nvme" else None
    wait_for_available(int((args.ceiling_gib + args.min_available_gib) * GIB), args.max_wait)
    if swap:
        os.makedirs(swap)
    try:
        cmds, envs = job.commands(
            system,
            mode,
            args.layers,
            args.width,
            args.seq_len,
            args.micro_batch,
            2,
            swap,
            args.ds_python,
            steps=args.steps,
        )
        envs = [dict(e, **VARIANT_ENV.get(variant, {})) for e in envs]
        res = run_job(
            cmds,
            envs,
            int(args.ceiling_gib * GIB),
            args.launch_timeout,
            min_available=int(args.min_available_gib * GIB / 2),
            cwd=ROOT,
        )
    finally:
        if swap:
            shutil.rmtree(swap, ignore_errors=True)
    if res.status != "ok" or len(res.results) != 2:
        tail = "\n".join(o[-2500:] for o in res.outputs)
        raise RuntimeError(f"{variant} launch {res.status}: {res.reason}\n{tail}")
    ranks = sorted(res.results, key=lambda r: r["rank"])
    steps = []
    for per_rank in zip(*(r["steps"] for r in ranks), strict=True):
        steps.append(
            {
                "wall": max(s["wall"] for s in per_rank),
                "read": sum(s["read_bytes"] for s in per_rank),
                "write": sum(s["write_bytes"] for s in per_rank),
                **{p: max(s[p] for s in per_rank) for p in ("forward", "backward", "step")},
                "fetch_wait": max(s.get("fetch_wait", 0.0) for s in per_rank),
                "loss": per_rank[0]["loss"],
            }
        )
    return {
        "steps": steps[args.warmup :],
        "all_steps": steps,
        "peak": res.peak_sum,
        "versions": ranks[0]["versions"],
    }


def one_pass(args: argparse.Namespace, index: int) -> dict:
    """dd, then every variant once (alternating launches)."""
    w, r = dd_bandwidth(args.nvme_dir, args.dd_mib)
    out = {"dd_write": w, "dd_read": r, "variants": {}, "failures": {}}
    print(
        f"[bench_infinity_speed] pass {index}: dd write {w / 1e6:.0f} MB/s, read {r / 1e6:.0f} MB/s",
        flush=True,
    )
    for variant in args.variants:
        t0 = time.perf_counter()
        try:
            res = launch(variant, args)
        except RuntimeError as exc:  # recorded and reported; the other variants and passes go on
            out["failures"][variant] = str(exc).splitlines()[0]
            # the whole message, with the ranks' output (the results file keeps its first line)
            print(f"[bench_infinity_speed] pass {index}: {variant}: {exc}", flush=True)
            continue
        out["variants"][variant] = res
        med = statistics.median(s["wall"] for s in res["steps"])
        moved = statistics.median(s["read"] + s["write"] for s in res["steps"])
        print(
            f"[bench_infinity_speed] pass {index}: {variant}: step {med:.2f} s (median of {len(res['steps'])}), "
            f"{moved / 1e9:.2f} GB swapped per step, peak RSS {res['peak'] / GIB:.2f} GiB, launch "
            f"{time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    return out


def pass_figures(p: dict) -> dict:
    """Per-pass figures of [Note: swap throughput and hidden compute]."""
    v = p["variants"]
    out = {}
    for name, res in v.items():
        t = statistics.median(s["wall"] for s in res["steps"])
        rd = statistics.median(s["read"] for s in res["steps"])
        wr = statistics.median(s["write"] for s in res["steps"])
        out[name] = {"t": t, "read": rd, "write": wr}
        if rd + wr > 0:
            t_io = rd / p["dd_read"] + wr / p["dd_write"]
            out[name].update(t_io=t_io, b_mix=(rd + wr) / t_io, throughput=(rd + wr) / t)
    for name, nv in out.items():
        ram = out.get(f"{VARIANTS[name][0]}-ram") if name in VARIANTS else None
        if ram and "t_io" in nv:
            nv["hidden"] = (ram["t"] + nv["t_io"] - nv["t"]) / min(ram["t"], nv["t_io"])
            nv["slowdown_vs_ram"] = nv["t"] / ram["t"]
    for num, den, _ in RATIOS:
        if num in out and den in out:
            out[f"ratio:{num}"] = out[num]["t"] / out[den]["t"]
    return out


def _q(values: list[float], fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    """``median (q1-q3)`` of ``values`` (one value: itself)."""
    if not values:
        return "-"
    q1, med, q3 = quartiles(values)
    return f"{fmt.format(med * scale)} ({fmt.format(q1 * scale)}-{fmt.format(q3 * scale)})"


def summary_lines(figs: list[dict], passes: list[dict], args: argparse.Namespace) -> list[str]:
    """The headline table (medians over passes, quartiles in brackets) and the per-pass table."""

    def col(name: str, key: str) -> list[float]:
        return [f[name][key] for f in figs if name in f and key in f[name]]

    lines = [
        "| variant | step time (s) | swapped per step: read / write (GB) | swap throughput (MB/s) | "
        "dd mixed bandwidth for that mix (MB/s) | throughput / mixed bandwidth (target >= 0.8) | "
        "swap time alone T_io (s) | step / same step in RAM | hidden (1 = fully overlapped) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.variants:
        t = col(name, "t")
        if not t:
            lines.append(f"| {name} | every launch failed | - | - | - | - | - | - | - |")
            continue
        row = f"| {name} | {_q(t)} | "
        if col(name, "b_mix"):
            ratio = [f[name]["throughput"] / f[name]["b_mix"] for f in figs if "b_mix" in f.get(name, {})]
            row += (
                f"{_q(col(name, 'read'), scale=1e-9)} / {_q(col(name, 'write'), scale=1e-9)} | "
                f"{_q(col(name, 'throughput'), '{:.0f}', 1e-6)} | {_q(col(name, 'b_mix'), '{:.0f}', 1e-6)} | "
                f"{_q(ratio)} | {_q(col(name, 't_io'))} | {_q(col(name, 'slowdown_vs_ram'))} | "
                f"{_q(col(name, 'hidden'))} |"
            )
        else:
            row += "- | - | - | - | - | 1 | - |"
        lines.append(row)
    ratios = [f["ratio:zero-nvme"] for f in figs if "ratio:zero-nvme" in f]
    lines += [
        "",
        f"**zero / DeepSpeed step time (NVMe), median of per-pass ratios (IQR): {_q(ratios)}** "
        f"(target <= 0.7; {len(ratios)} passes)",
    ]
    for num, _, headline in RATIOS[1:]:
        more = [f[f"ratio:{num}"] for f in figs if f"ratio:{num}" in f]
        if more:
            lines += ["", f"**{headline}: {_q(more)}** ({len(more)} passes)"]
    lines += [
        "",
        "Per pass (step time = median over a launch's steps after the warm-up, slowest rank per step):",
        "",
        "| pass | dd write / read (MB/s) | "
        + " | ".join(f"{n} step (s)" for n in args.variants)
        + " | zero/DS |",
        "|---|---|" + "---|" * len(args.variants) + "---|",
    ]
    for i, (p, f) in enumerate(zip(passes, figs, strict=True)):
        cells = " | ".join(f"{f[n]['t']:.2f}" if n in f else "failed" for n in args.variants)
        r = f"{f['ratio:zero-nvme']:.2f}" if "ratio:zero-nvme" in f else "-"
        lines.append(f"| {i + 1} | {p['dd_write'] / 1e6:.0f} / {p['dd_read'] / 1e6:.0f} | {cells} | {r} |")
    return lines


def phase_lines(passes: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [
        "| variant | forward (s) | backward (s) | optimizer step (s) | parameter fetches waiting for the disk (s) "
        "| peak RSS, sum of ranks (GiB) | losses (first launch) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in args.variants:
        ran = [p["variants"][name] for p in passes if name in p["variants"]]
        if not ran:
            continue
        steps = [s for r in ran for s in r["steps"]]
        peaks = [r["peak"] for r in ran]
        losses = ", ".join(f"{s['loss']:.4f}" for s in ran[0]["all_steps"])
        lines.append(
            f"| {name} | "
            + " | ".join(
                f"{statistics.median(s[ph] for s in steps):.2f}" for ph in ("forward", "backward", "step")
            )
            + f" | {_fetch_wait_cell(name, steps)} | {max(peaks) / GIB:.2f} | {losses} |"
        )
    return lines


def _fetch_wait_cell(variant: str, steps: list[dict]) -> str:
    """zero NVMe: median per step of the slowest rank's fetch waits (forward and backward); else -."""
    if not variant.startswith("zero-nvme"):
        return "-"
    return f"{statistics.median(s['fetch_wait'] for s in steps):.2f}"


def failure_lines(passes: list[dict]) -> list[str]:
    """The launches that did not finish (left out of every figure), one line each."""
    out = [f"- pass {i + 1}, {v}: {why}" for i, p in enumerate(passes) for v, why in p["failures"].items()]
    return ["Launches that failed (left out of the figures):", "", *out, ""] if out else []


def loss_agreement(passes: list[dict]) -> str:
    """How closely every launch's losses match the first zero-nvme launch's (same init, same batches)."""
    first = next((p["variants"]["zero-nvme"] for p in passes if "zero-nvme" in p["variants"]), {})
    ref = [s["loss"] for s in first.get("all_steps", [])]
    if not ref:
        return "no zero-nvme launch to compare with"
    worst = 0.0
    for p in passes:
        for res in p["variants"].values():
            for a, b in zip(ref, (s["loss"] for s in res["all_steps"]), strict=False):
                worst = max(worst, abs(a - b) / abs(a))
    return f"every launch's per-step losses within {worst:.1e} (relative) of the first zero-nvme launch's"


QUIET_COMMAND = (
    "python tools/bench/bench_infinity_speed.py --nvme-dir /path/on/the/nvme/disk "
    "--ds-python /path/to/deepspeed/venv/bin/python --label 'quiet machine'"
)


def write_results(
    args: argparse.Namespace, passes: list[dict], load: LoadLog, command: str, wall: float
) -> str:
    figs = [pass_figures(p) for p in passes]
    v: dict = {}
    for p in passes:
        for res in p["variants"].values():
            v.update(res["versions"])
    params = job.block_params(args.width) * args.layers + (256 + args.seq_len + 2) * args.width
    lines = [
        "# bench_infinity_speed: ZeRO-Infinity (stage 3, parameters and optimizer states on NVMe), zero vs DeepSpeed",
        "",
        f"**{args.label}**" if args.label else "",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), RAM {meminfo()['MemTotal'] / GIB:.1f} GiB, "
        f"{platform.platform()}; swap folder {args.nvme_dir}",
        f"- load: {load.describe()}",
        f"- versions: python {v.get('python', '?')}, torch {v.get('torch', '?')}, zero {v.get('zero', '?')}, "
        f"DeepSpeed {v.get('deepspeed', 'not run')} (own venv, DS_ACCELERATOR=cpu, its cpu_adam and async_io ops)",
        f"- git commit: {args.commit} (when the run started)",
        f"- command: `{command}`",
        f"- model: examples/ GPT, width {args.width}, {args.layers} blocks, {params / 1e6:.1f}M parameters, fp32, "
        f"Adam; seq_len {args.seq_len}, micro-batch {args.micro_batch} per rank, 2 ranks; model states "
        f"{16 * params / 2**30:.2f} GiB",
        "- config: the same DeepSpeed JSON for both systems ([Note: one config for every system] in "
        "tools/bench/_gpt_job.py): stage 3, offload_param nvme (buffer_count "
        f"{job.PARAM_BUFFERS}, buffer_size one 4w x w matrix, max_in_cpu 0), offload_optimizer nvme "
        f"(buffer_count {job.OPT_BUFFERS}, pipeline_read/write off), sub_group_size one block, prefetch_bucket_size "
        "one 4w x w matrix, max_live_parameters three blocks; the RAM variants drop the two offload sections",
        f"- same initialisation and data for both systems: {loss_agreement(passes)}",
        f"- {args.passes} passes; per pass dd ({args.dd_mib} MiB, O_DIRECT) then one launch per variant in the "
        f"order {', '.join(args.variants)}; {args.steps} steps a launch, the first {args.warmup} left out",
        "- definitions: [Note: swap throughput and hidden compute] in tools/bench/bench_infinity_speed.py. Cells: "
        "median over passes (interquartile range)",
        f"- total wall time {wall / 60:.0f} min",
        "",
        *summary_lines(figs, passes, args),
        "",
        *failure_lines(passes),
        "Per phase (median over every measured step, slowest rank), peak RSS over the launches:",
        "",
        *phase_lines(passes, args),
        "",
        "## Re-running on a quiet machine",
        "",
        "```",
        QUIET_COMMAND,
        "```",
        "",
    ]
    text = "\n".join(lines)
    from zero_core.checkpoint.atomic import atomic_write_text

    atomic_write_text(args.out, text)
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--nvme-dir", default=os.path.join(ROOT, ".bench_nvme_tmp"), help="swap folder on the disk"
    )
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--dd-mib", type=int, default=2048)
    ap.add_argument(
        "--variants",
        default="zero-nvme,deepspeed-nvme,zero-ram,zero-nvme-heap32,zero-nvme-thp,deepspeed-nvme-thp",
        help=f"comma-separated, from {', '.join(VARIANTS)} (deepspeed-ram: DeepSpeed's own hidden fraction; "
        "its stage 3 in RAM peaks far higher than zero's)",
    )
    ap.add_argument(
        "--ceiling-gib", type=float, default=16.0, help="memory ceiling of a launch (sum of peak RSS)"
    )
    ap.add_argument("--min-available-gib", type=float, default=4.0)
    ap.add_argument("--max-wait", type=float, default=3600.0)
    ap.add_argument("--launch-timeout", type=float, default=1800.0)
    ap.add_argument("--disk-reserve-gib", type=float, default=5.0)
    ap.add_argument("--ds-python", default="/work/dsvenv/bin/python")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_infinity_speed.md"))
    ap.add_argument(
        "--label", default="", help="a line at the top of the results file (e.g. the machine's state)"
    )
    args = ap.parse_args(argv)
    args.variants = [x for x in args.variants.split(",") if x]
    if not set(args.variants) <= set(VARIANTS) or not args.variants:
        ap.error(f"--variants from {list(VARIANTS)}")
    if args.steps <= args.warmup or args.passes < 1 or args.layers < 1 or args.width % 64:
        ap.error("need --steps > --warmup, --passes >= 1, --layers >= 1, --width a multiple of 64")
    if any(VARIANTS[x][0] == "deepspeed" for x in args.variants) and not os.access(args.ds_python, os.X_OK):
        ap.error(f"--ds-python {args.ds_python} is not an executable (DeepSpeed's venv python)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.commit = git_commit("tools/bench", "packages", "examples")  # the code measured, before any edit
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # run the cleanups (kill the job, remove swap files)
    command = shlex.join(
        ["python", "tools/bench/bench_infinity_speed.py", *(argv if argv is not None else sys.argv[1:])]
    )
    os.makedirs(args.nvme_dir, exist_ok=True)
    params = job.block_params(args.width) * args.layers
    st = os.statvfs(args.nvme_dir)
    need = 20 * params + max(args.dd_mib * 2**20, 0) + int(args.disk_reserve_gib * GIB)
    if st.f_bavail * st.f_frsize < need:
        raise SystemExit(
            f"{args.nvme_dir}: {st.f_bavail * st.f_frsize / GIB:.1f} GiB free, need {need / GIB:.1f} GiB "
            "(20 B/param of swap for one system at a time, the dd file, the reserve)"
        )
    load = LoadLog()
    passes = []
    t0 = time.perf_counter()
    for i in range(args.passes):
        passes.append(one_pass(args, i + 1))
        load.sample()
    print(write_results(args, passes, load, command, time.perf_counter() - t0))


if __name__ == "__main__":
    main()
