"""The autotuner against an exhaustive grid over the same space, on the examples/ GPT, 2 ranks.

    OMP_NUM_THREADS=1 hatch run python tools/bench/bench_autotune.py

Both searches are ``zero run --autotuning tune`` over the same space (ZeRO stage x micro-batch
x ``reduce_bucket_size``; the other knobs fixed) with their own ``exps_dir`` (nothing reused):
the grid is ``tuner_type: gridsearch`` with early stopping off (every point launched), the tuner
is ``model_based`` with ``tuner_early_stopping`` (and stage early stopping, see [Note: autotuning
search]). Reported: the tuner's best throughput against the grid's best (both as measured by
their own runs, and the grid's own measurement of the config the tuner chose, which takes the
run-to-run noise out of the comparison), and the wall time of each search.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_env import ROOT, cpu_model, git_commit  # noqa: E402


def _search(work: str, tuner: str, args: argparse.Namespace) -> dict:
    os.makedirs(work, exist_ok=True)
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": [0, 1, 2, 3],
            "reduce_bucket_size": args.buckets,
            "allgather_bucket_size": 500_000_000,
            "stage3_prefetch_bucket_size": 500_000_000,
            "overlap_comm": True,
        },
        "autotuning": {
            "enabled": True,
            "fast": False,
            "start_profile_step": args.start,
            "end_profile_step": args.end,
            "min_train_micro_batch_size_per_gpu": min(args.mbs),
            "max_train_micro_batch_size_per_gpu": max(args.mbs),
            "num_tuning_micro_batch_sizes": len(args.mbs),
            "tuner_type": tuner,
            "tuner_early_stopping": 1000 if tuner == "gridsearch" else args.early_stopping,
            "model_info": {"num_params": args.num_params},
            "results_dir": os.path.join(work, "results"),
            "exps_dir": os.path.join(work, "exps"),
        },
    }
    path = os.path.join(work, "cfg.json")
    with open(path, "w") as f:
        json.dump(config, f)
    gpt = ["--steps", str(args.end + 1), "--seq_len", "64", "--d_model", str(args.d_model), "--n_layers", "2"]
    gpt += ["--n_heads", "4", "--corpus_bytes", "200000", "--no_save", "--out_dir", os.path.join(work, "out")]
    cmd = [sys.executable, "-m", "zero_core.launcher", "run", "--autotuning", "tune", "--nproc", "2"]
    cmd += [os.path.join(ROOT, "examples", "train_gpt.py"), "--zero_config", path, *gpt]
    start = time.perf_counter()
    out = subprocess.run(
        cmd, cwd=work, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(
            f"bench_autotune: the {tuner} search failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    with open(os.path.join(work, "search.json"), "w") as f:
        json.dump({"wall": wall}, f)
    return {"wall": wall, "records": _records(work), "stdout": out.stdout}


def _records(work: str) -> list[dict]:
    exps = os.path.join(work, "exps")
    records = []
    for name in sorted(os.listdir(exps)):
        with open(os.path.join(exps, name)) as f:
            records.append(json.load(f)["result"])
    return records


def _earlier_grid(work: str) -> dict:
    """The grid of an earlier run of this benchmark (same space, same work directory)."""
    with open(os.path.join(work, "search.json")) as f:
        wall = json.load(f)["wall"]
    return {"wall": wall, "records": _records(work), "stdout": ""}


def _key(r: dict) -> tuple:
    return (r["stage"], r["mbs"], r["knobs"].get("reduce_bucket_size"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mbs", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--buckets", type=int, nargs="+", default=[20_000, 2_000_000])
    p.add_argument("--start", type=int, default=2)
    p.add_argument("--end", type=int, default=5)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--early_stopping", type=int, default=2)
    p.add_argument(
        "--reuse_grid",
        action="store_true",
        help="take the grid from an earlier run in --work (its records and wall time) and run only the tuner",
    )
    p.add_argument("--work", default="/tmp/bench_autotune")
    p.add_argument("--out", default=os.path.join(ROOT, "tools", "bench", "results", "bench_autotune.md"))
    args = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, GPTConfig, num_params

    # given to both searches, so neither spends a launch on the model information
    args.num_params = num_params(GPT(GPTConfig(seq_len=64, d_model=args.d_model, n_layers=2, n_heads=4)))
    load0 = os.getloadavg()[0]
    began = time.perf_counter()
    tuned = _search(os.path.join(args.work, "tuner"), "model_based", args)
    if args.reuse_grid:
        grid = _earlier_grid(os.path.join(args.work, "grid"))
    else:
        grid = _search(os.path.join(args.work, "grid"), "gridsearch", args)
    load1 = os.getloadavg()[0]
    grid_ok = {_key(r): r for r in grid["records"] if r["status"] == "ok"}
    tuner_ok = [r for r in tuned["records"] if r["status"] == "ok"]
    g_best = max(grid_ok.values(), key=lambda r: r["metric"])
    t_best = max(tuner_ok, key=lambda r: r["metric"])
    t_in_grid = grid_ok.get(_key(t_best))
    space = 4 * len(args.mbs) * len(args.buckets)
    rows = [
        "| search | experiments launched | wall (s) | best config (stage, mbs, reduce_bucket_size) | best samples/s |",
        "|---|---|---|---|---|",
        f"| exhaustive grid | {len(grid['records'])} of {space} | {grid['wall']:.0f} | {_key(g_best)} | {g_best['metric']:.1f} |",
        f"| model_based tuner | {len(tuned['records'])} | {tuned['wall']:.0f} | {_key(t_best)} | {t_best['metric']:.1f} |",
    ]
    ratio_own = t_best["metric"] / g_best["metric"]
    ratio_grid = (t_in_grid["metric"] / g_best["metric"]) if t_in_grid else float("nan")
    grid_sorted = sorted(grid_ok.values(), key=lambda r: -r["metric"])
    table = [
        "| stage | mbs | reduce_bucket_size | grid samples/s | tuner samples/s |",
        "|---|---|---|---|---|",
    ]
    tuner_by_key = {_key(r): r for r in tuned["records"]}
    for r in grid_sorted:
        t = tuner_by_key.get(_key(r))
        t_val = f"{t['metric']:.1f}" if t and t["status"] == "ok" else "-"
        table.append(
            f"| {r['stage']} | {r['mbs']} | {r['knobs'].get('reduce_bucket_size')} | {r['metric']:.1f} | {t_val} |"
        )
    lines = [
        "# bench_autotune: the autotuner vs an exhaustive grid (examples/ GPT, 2 ranks, gloo, CPU)",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.system()} {platform.release()}; shared with "
        f"other jobs (other helpers' builds and tests): 1-minute load average {load0:.1f} at start, {load1:.1f} at end",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- git commit: {git_commit('packages/zero-core', 'tools/bench')}",
        f"- command: `OMP_NUM_THREADS=1 hatch run python tools/bench/bench_autotune.py {' '.join(sys.argv[1:])}`",
        f"- space: stage 0-3 x micro-batch {args.mbs} x reduce_bucket_size {args.buckets} = {space} points "
        "(allgather/prefetch buckets 5e8, overlap_comm on); GPT d_model "
        f"{args.d_model}, 2 layers, seq 64; samples/s measured by the engine between optimizer steps "
        f"{args.start} and {args.end}; each experiment is a fresh 2-rank launch",
        f"- tuner: model_based, tuner_early_stopping {args.early_stopping}, stage early stopping; grid: gridsearch, "
        "no early stopping; "
        + (
            "the grid is an earlier run's (--reuse_grid: its records and wall time), the tuner ran now"
            if args.reuse_grid
            else "the tuner ran first, then the grid"
        )
        + f"; bench wall {time.perf_counter() - began:.0f} s",
        "",
        *rows,
        "",
        f"- tuner's best / grid's best, each as its own run measured it: **{ratio_own:.3f}**",
        f"- the grid's measurement of the tuner's chosen config / grid's best: **{ratio_grid:.3f}** "
        "(same run, so run-to-run drift is out of it)",
        f"- tuner wall time / grid wall time: **{tuned['wall'] / grid['wall']:.3f}** (target <= 0.30); "
        f"experiments {len(tuned['records'])} / {len(grid['records'])}",
        "",
        "Every grid point (best first), with the tuner's measurement where it ran the same config:",
        "",
        *table,
        "",
        "Noise: each point is one short run (a few optimizer steps of a small model) on a machine shared by "
        "other jobs, so two runs of one config differ by tens of percent (compare the two columns); a "
        "difference between configs smaller than that is not a finding. Wall times are dominated by the "
        "launches (process start, torch import, gloo setup), so the wall ratio tracks the ratio of launches.",
    ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
