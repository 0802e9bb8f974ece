"""The autotuner against an exhaustive grid over the same space, on the examples/ GPT, 2 ranks.

    OMP_NUM_THREADS=1 hatch run python tools/bench/bench_autotune.py

Both searches are ``zero run --autotuning tune`` over the same space (ZeRO stage x micro-batch
x ``reduce_bucket_size``; the other knobs fixed), each with fresh directories (nothing reused):
the grid is ``tuner_type: gridsearch`` with early stopping off (every point launched), the tuner
is ``model_based`` with ``tuner_early_stopping`` (and stage early stopping, see [Note: autotuning
search]). The two run interleaved for ``--rounds`` rounds (tuner first in even rounds, grid
first in odd ones), so that load on a shared machine falls on both; the 1-minute load average is
recorded around every search. Reported: medians over the rounds of each side's wall time and
best throughput (as its own runs measured it), their ratios, and the grids' median measurement
of each config the tuner chose against the grids' best config (which takes the tuner's own run
and the grid's winner's luck out of the comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_env import ROOT, cpu_model, git_commit  # noqa: E402


def _search(work: str, tuner: str, args: argparse.Namespace, point: tuple | None = None) -> dict:
    """One ``zero run --autotuning tune`` over the space (or over the single ``point``: one launch)."""
    shutil.rmtree(work, ignore_errors=True)  # fresh: nothing reused from an earlier run
    os.makedirs(work)
    stages, mbs, buckets = (
        ([point[0]], [point[1]], [point[2]]) if point else ([0, 1, 2, 3], args.mbs, args.buckets)
    )
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stages,
            "reduce_bucket_size": buckets,
            "allgather_bucket_size": 500_000_000,
            "stage3_prefetch_bucket_size": 500_000_000,
            "overlap_comm": True,
        },
        "autotuning": {
            "enabled": True,
            "fast": False,
            "start_profile_step": args.start,
            "end_profile_step": args.end,
            "min_train_micro_batch_size_per_gpu": min(mbs),
            "max_train_micro_batch_size_per_gpu": max(mbs),
            "num_tuning_micro_batch_sizes": len(mbs),
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
    return {"wall": wall, "records": _records(work)}


def _records(work: str) -> list[dict]:
    exps = os.path.join(work, "exps")
    records = []
    for name in sorted(os.listdir(exps)):
        with open(os.path.join(exps, name)) as f:
            records.append(json.load(f)["result"])
    return records


def _key(r: dict) -> tuple:
    return (r["stage"], r["mbs"], r["knobs"].get("reduce_bucket_size"))


def _best(records: list[dict]) -> dict:
    return max((r for r in records if r["status"] == "ok"), key=lambda r: r["metric"])


def _fmt_key(key: tuple) -> str:
    return f"({key[0]}, {key[1]}, {key[2]:.0e})"


def _rounds(args: argparse.Namespace) -> list[dict]:
    """Every search, tuner and grid interleaved, with the load average around each."""
    runs: list[dict] = []
    saved = os.path.join(args.work, "runs.json")
    if args.resume and os.path.isfile(saved):  # continue an earlier run's rounds (complete ones only)
        with open(saved) as f:
            runs = json.load(f)
        for x in runs:
            x["load"] = tuple(x["load"])
        done = {x["round"] for x in runs if sum(y["round"] == x["round"] for y in runs) == 2}
        runs = [x for x in runs if x["round"] in done]
    for r in range(len({x["round"] for x in runs}), args.rounds):
        order = ["model_based", "gridsearch"] if r % 2 == 0 else ["gridsearch", "model_based"]
        for tuner in order:
            side = "grid" if tuner == "gridsearch" else "tuner"
            load0 = os.getloadavg()[0]
            found = _search(os.path.join(args.work, f"round{r}", side), tuner, args)
            found.update(round=r, side=side, load=(load0, os.getloadavg()[0]), best=_best(found["records"]))
            runs.append(found)
            with open(saved, "w") as f:  # kept for --report_only and --resume
                json.dump(runs, f)
            b = found["best"]
            print(
                f"round {r} {side}: {len(found['records'])} experiments, {found['wall']:.0f} s, best "
                f"{_fmt_key(_key(b))} {b['metric']:.1f} samples/s, load {found['load'][0]:.1f}-{found['load'][1]:.1f}",
                flush=True,
            )
    return runs


def _confirm(args: argparse.Namespace, runs: list[dict]) -> dict[str, list[float]]:
    """Each config a search picked, measured again ``--confirm`` times (configs interleaved): what
    a search delivers is its pick's throughput, not its own luckiest measurement (the grid's best
    is the largest of 24 noisy runs, a winner's curse the tuner's few runs have less of)."""
    picks = sorted({_key(x["best"]) for x in runs})
    measured: dict[str, list[float]] = {str(k): [] for k in picks}
    for i in range(args.confirm):
        for k in picks:
            found = _search(os.path.join(args.work, "confirm", f"{i}"), "gridsearch", args, point=k)
            ok = [r["metric"] for r in found["records"] if r["status"] == "ok"]
            measured[str(k)] += ok
            print(f"confirm {i} {_fmt_key(k)}: {ok} (load {os.getloadavg()[0]:.1f})", flush=True)
    with open(os.path.join(args.work, "confirm.json"), "w") as f:
        json.dump(measured, f)
    return measured


def _grid_medians(grids: list[dict]) -> dict[tuple, list[float]]:
    """Every grid point's measurements over the grid runs (failed runs left out)."""
    points: dict[tuple, list[float]] = {}
    for g in grids:
        for rec in g["records"]:
            if rec["status"] == "ok":
                points.setdefault(_key(rec), []).append(rec["metric"])
    return points


def _confirmed_lines(runs: list[dict], confirmed: dict[str, list[float]]) -> list[str]:
    """The picks' re-measurements and, per round, tuner's pick / grid's pick (medians)."""
    if not confirmed:
        return []
    med = statistics.median
    lines = ["", "Every search's pick measured again (configs interleaved, fresh launches):", ""]
    lines += ["| config (stage, mbs, bucket) | samples/s (each run) | median |", "|---|---|---|"]
    for k, vals in confirmed.items():
        lines.append(f"| {k} | {', '.join(f'{v:.1f}' for v in vals)} | {med(vals):.1f} |")
    ratios = []
    for r in sorted({x["round"] for x in runs}):
        t, g = (
            str(_key(x["best"]))
            for side in ("tuner", "grid")
            for x in runs
            if x["round"] == r and x["side"] == side
        )
        ratios.append(med(confirmed[t]) / med(confirmed[g]))
    lines += [
        "",
        f"- **the tuner's pick / the grid's pick, each re-measured (median): {med(ratios):.3f}** (target >= 0.95); "
        "per round: " + ", ".join(f"{x:.3f}" for x in ratios),
    ]
    return lines


def _report(
    args: argparse.Namespace, runs: list[dict], began: float, confirmed: dict[str, list[float]]
) -> list[str]:
    grids = [x for x in runs if x["side"] == "grid"]
    tuners = [x for x in runs if x["side"] == "tuner"]
    med = statistics.median
    points = _grid_medians(grids)
    best_key = max(points, key=lambda k: med(points[k]))
    best_med = med(points[best_key])
    space = 4 * len(args.mbs) * len(args.buckets)
    wall_ratio = med(t["wall"] for t in tuners) / med(g["wall"] for g in grids)
    own_ratio = med(t["best"]["metric"] for t in tuners) / med(g["best"]["metric"] for g in grids)
    per_round = [
        (t["wall"] / g["wall"], t["best"]["metric"] / g["best"]["metric"])
        for t, g in zip(tuners, grids, strict=True)
    ]
    picks = [_key(t["best"]) for t in tuners]
    pick_ratios = [med(points[k]) / best_med if k in points else float("nan") for k in picks]
    rows = [
        "| round | search | load avg (start-end) | experiments | wall (s) | best (stage, mbs, bucket) | its samples/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in runs:
        rows.append(
            f"| {x['round']} | {x['side']} | {x['load'][0]:.1f}-{x['load'][1]:.1f} | {len(x['records'])} of {space} "
            f"| {x['wall']:.0f} | {_fmt_key(_key(x['best']))} | {x['best']['metric']:.1f} |"
        )
    table = [
        "| stage | mbs | reduce_bucket_size | grid samples/s (each run) | median | / best median |",
        "|---|---|---|---|---|---|",
    ]
    for k in sorted(points, key=lambda k: -med(points[k])):
        vals = ", ".join(f"{v:.1f}" for v in points[k])
        mark = " (tuner's pick)" if k in picks else ""
        table.append(
            f"| {k[0]} | {k[1]} | {k[2]:.0e} | {vals} | {med(points[k]):.1f} | {med(points[k]) / best_med:.3f}{mark} |"
        )
    loads = [v for x in runs for v in x["load"]]
    return [
        "# bench_autotune: the autotuner vs an exhaustive grid (examples/ GPT, 2 ranks, gloo, CPU)",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.system()} {platform.release()}; shared with "
        f"other jobs (other helpers' builds and tests): 1-minute load average {min(loads):.1f}-{max(loads):.1f} "
        "over the run (per search below)",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- git commit: {git_commit('packages/zero-core', 'tools/bench')}",
        f"- command: `OMP_NUM_THREADS=1 hatch run python tools/bench/bench_autotune.py {' '.join(sys.argv[1:])}`",
        f"- space: stage 0-3 x micro-batch {args.mbs} x reduce_bucket_size {args.buckets} = {space} points "
        "(allgather/prefetch buckets 5e8, overlap_comm on); GPT d_model "
        f"{args.d_model}, 2 layers, seq 64; samples/s measured by the engine between optimizer steps "
        f"{args.start} and {args.end}; each experiment is a fresh 2-rank launch",
        f"- tuner: model_based, tuner_early_stopping {args.early_stopping}, stage early stopping; grid: gridsearch, "
        f"no early stopping; {len(tuners)} rounds, interleaved (tuner first in even rounds); the searches' "
        f"total wall {sum(x['wall'] for x in runs):.0f} s (this invocation {time.perf_counter() - began:.0f} s)",
        "",
        *rows,
        "",
        f"- wall time, median tuner / median grid: **{wall_ratio:.3f}** (target <= 0.30); per round: "
        + ", ".join(f"{w:.3f}" for w, _ in per_round),
        f"- best throughput, median of the tuner's own bests / median of the grid's own bests: **{own_ratio:.3f}** "
        "(target >= 0.95); per round: " + ", ".join(f"{b:.3f}" for _, b in per_round),
        f"- the grids' median measurement of each config the tuner picked / the grids' best config "
        f"{_fmt_key(best_key)} (median {best_med:.1f}): "
        + ", ".join(f"{_fmt_key(k)} **{r:.3f}**" for k, r in zip(picks, pick_ratios, strict=True)),
        *_confirmed_lines(runs, confirmed),
        "",
        "Every grid point (best median first):",
        "",
        *table,
        "",
        "Noise: each point is one short run (a few optimizer steps of a small model) on a shared machine; "
        "compare a config's runs across rounds. Wall times are dominated by the launches (process start, "
        "torch import, gloo setup), so the wall ratio tracks the ratio of launches.",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mbs", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--buckets", type=int, nargs="+", default=[20_000, 2_000_000])
    p.add_argument("--start", type=int, default=2)
    p.add_argument("--end", type=int, default=5)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--early_stopping", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="interleaved tuner/grid rounds (>= 2 for medians)")
    p.add_argument(
        "--report_only", action="store_true", help="write the report from the searches saved in --work"
    )
    p.add_argument(
        "--resume", action="store_true", help="keep the complete rounds saved in --work, run the rest"
    )
    p.add_argument(
        "--confirm", type=int, default=3, help="re-measure every search's pick this many times (0: not)"
    )
    p.add_argument("--work", default="/tmp/bench_autotune")
    p.add_argument("--out", default=os.path.join(ROOT, "tools", "bench", "results", "bench_autotune.md"))
    args = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, GPTConfig, num_params

    # given to both searches, so neither spends a launch on the model information
    args.num_params = num_params(GPT(GPTConfig(seq_len=64, d_model=args.d_model, n_layers=2, n_heads=4)))
    began = time.perf_counter()
    if args.report_only:
        with open(os.path.join(args.work, "runs.json")) as f:
            runs = json.load(f)
        for x in runs:
            x["load"] = tuple(x["load"])
    else:
        runs = _rounds(args)
    confirmed = _confirm(args, runs) if args.confirm else {}
    lines = _report(args, runs, began, confirmed)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
