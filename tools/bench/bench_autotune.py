"""The autotuner against an exhaustive grid over the same space, on the examples/ GPT, 2 ranks.

    OMP_NUM_THREADS=1 hatch run python tools/bench/bench_autotune.py --rounds 2

The target (issue 21): the tuner's best throughput within 5% of the exhaustive grid's best, in
at most 30% of its wall time. Per round:

1. both searches, interleaved (tuner first in even rounds, grid first in odd ones), each a
   ``zero run --autotuning tune`` over the same space (ZeRO stage x micro-batch x
   ``reduce_bucket_size``; the other knobs fixed) with fresh directories (nothing reused): the
   grid is ``tuner_type: gridsearch`` with early stopping off (every point launched), the tuner
   ``model_based`` with ``tuner_early_stopping`` and stage early stopping. Both end with the
   autotuner's confirm phase (on by default, see [Note: autotuning confirm phase]); each
   search's wall time includes it. A search's *pick* is its ``ds_config_optimal.json``.
2. the two picks measured again, interleaved (tuner's, grid's, tuner's, ...), ``--remeasure``
   fresh launches each over a longer window (``--remeasure_end``): what a search delivers is its
   pick's throughput, not its own luckiest measurement. Equal picks give the ratio 1 without
   launches.

Reported: per round, the wall ratio (tuner / grid) and the throughput ratio (median of the
tuner's pick's re-measurements / the grid pick's); over the rounds, the median and the
interquartile range of both, and the 1-minute load average around every search.
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
from zero_profiler.autotuning.confirm import confirm_window_end

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_env import ROOT, cpu_model, git_commit  # noqa: E402

STAGES = [0, 1, 2, 3]


def _search(work: str, tuner: str, args: argparse.Namespace, point: tuple | None = None) -> dict:
    """One ``zero run --autotuning tune`` over the space (or over the single ``point``: one launch,
    profiled to ``--remeasure_end``)."""
    shutil.rmtree(work, ignore_errors=True)  # fresh: nothing reused from an earlier run
    os.makedirs(work)
    stages, mbs, buckets = ([point[0]], [point[1]], [point[2]]) if point else (STAGES, args.mbs, args.buckets)
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
            "end_profile_step": args.remeasure_end if point else args.end,
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
    steps = max(args.end, args.remeasure_end, confirm_window_end(args.start, args.end)) + 1
    gpt = ["--steps", str(steps), "--seq_len", "64", "--d_model", str(args.d_model), "--n_layers", "2"]
    gpt += ["--n_heads", "4", "--corpus_bytes", "200000", "--no_save", "--out_dir", os.path.join(work, "out")]
    cmd = [sys.executable, "-m", "zero_core.launcher", "run", "--autotuning", "tune", "--nproc", "2"]
    cmd += [os.path.join(ROOT, "examples", "train_gpt.py"), "--zero_config", path, *gpt]
    load0, start = os.getloadavg()[0], time.perf_counter()
    out = subprocess.run(
        cmd, cwd=work, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(
            f"bench_autotune: the {tuner} search failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    with open(os.path.join(work, "results", "ds_config_optimal.json")) as f:
        optimal = json.load(f)
    zo = optimal["zero_optimization"]
    pick = (zo["stage"], optimal["train_micro_batch_size_per_gpu"], zo["reduce_bucket_size"])
    return {"wall": wall, "records": _records(work), "pick": pick, "load": (load0, os.getloadavg()[0])}


def _records(work: str) -> list[dict]:
    exps = os.path.join(work, "exps")
    records = []
    for name in sorted(os.listdir(exps)):
        with open(os.path.join(exps, name)) as f:
            records.append(json.load(f)["result"])
    return records


def _remeasure(args: argparse.Namespace, r: int, picks: dict[str, tuple]) -> dict[str, list[float]]:
    """Each side's pick, ``--remeasure`` fresh launches, interleaved; {} when the picks are equal."""
    if picks["tuner"] == picks["grid"]:
        return {}
    measured: dict[str, list[float]] = {"tuner": [], "grid": []}
    for i in range(args.remeasure):
        for side in ("tuner", "grid") if i % 2 == 0 else ("grid", "tuner"):
            found = _search(
                os.path.join(args.work, f"round{r}", "remeasure"), "gridsearch", args, picks[side]
            )
            measured[side] += [x["metric"] for x in found["records"] if x["status"] == "ok"]
            print(f"round {r} re-measure {side} {_fmt(picks[side])}: {measured[side]}", flush=True)
    return measured


def _round(args: argparse.Namespace, r: int) -> dict:
    """Both searches (interleaved order) and the re-measurement of their picks."""
    out: dict = {"round": r}
    for side in ("tuner", "grid") if r % 2 == 0 else ("grid", "tuner"):
        tuner = "model_based" if side == "tuner" else "gridsearch"
        out[side] = _search(os.path.join(args.work, f"round{r}", side), tuner, args)
        s = out[side]
        print(
            f"round {r} {side}: {len(s['records'])} experiments, {s['wall']:.0f} s, pick {_fmt(s['pick'])}, "
            f"load {s['load'][0]:.1f}-{s['load'][1]:.1f}",
            flush=True,
        )
    load0 = os.getloadavg()[0]
    out["remeasured"] = _remeasure(args, r, {s: out[s]["pick"] for s in ("tuner", "grid")})
    out["remeasure_load"] = (load0, os.getloadavg()[0])
    m = out["remeasured"]
    out["ratio"] = statistics.median(m["tuner"]) / statistics.median(m["grid"]) if m else 1.0
    out["wall_ratio"] = out["tuner"]["wall"] / out["grid"]["wall"]
    return out


def _fmt(key: tuple) -> str:
    return f"({key[0]}, {key[1]}, {key[2]:.0e})"


def _iqr(values: list[float]) -> str:
    if len(values) < 2:
        return "-"
    q = statistics.quantiles(values, n=4, method="inclusive")
    return f"{q[0]:.3f}-{q[2]:.3f}"


def _search_rows(rounds: list[dict], space: int) -> list[str]:
    rows = [
        "| round | search | load avg (start-end) | launches (search + confirm) | wall (s) | pick (stage, mbs, bucket) |",
        "|---|---|---|---|---|---|",
    ]
    for x in rounds:
        for side in ("tuner", "grid"):
            s = x[side]
            n = {
                p: sum(rec.get("phase", "search") == p for rec in s["records"]) for p in ("search", "confirm")
            }
            rows.append(
                f"| {x['round']} | {side} | {s['load'][0]:.1f}-{s['load'][1]:.1f} | {n['search']} of {space} + "
                f"{n['confirm']} | {s['wall']:.0f} | {_fmt(s['pick'])} |"
            )
    return rows


def _ratio_rows(rounds: list[dict]) -> list[str]:
    rows = [
        "| round | tuner's pick: samples/s (each run) | grid's pick: samples/s (each run) | load avg | "
        "tuner / grid (medians) | wall tuner / grid |",
        "|---|---|---|---|---|---|",
    ]
    for x in rounds:
        m = x["remeasured"]
        t, g = (", ".join(f"{v:.1f}" for v in m[s]) if m else "same config" for s in ("tuner", "grid"))
        load = f"{x['remeasure_load'][0]:.1f}-{x['remeasure_load'][1]:.1f}" if m else "-"
        rows.append(f"| {x['round']} | {t} | {g} | {load} | {x['ratio']:.3f} | {x['wall_ratio']:.3f} |")
    return rows


def _report(args: argparse.Namespace, rounds: list[dict], began: float) -> list[str]:
    space = len(STAGES) * len(args.mbs) * len(args.buckets)
    ratios, walls = [x["ratio"] for x in rounds], [x["wall_ratio"] for x in rounds]
    loads = [v for x in rounds for s in ("tuner", "grid") for v in x[s]["load"]]
    med = statistics.median
    return [
        "# bench_autotune: the autotuner vs an exhaustive grid (examples/ GPT, 2 ranks, gloo, CPU)",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.system()} {platform.release()}; "
        f"1-minute load average {min(loads):.1f}-{max(loads):.1f} over the searches (per search below)",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- git commit: {git_commit('packages/zero-core', 'packages/zero-profiler', 'tools/bench')}",
        f"- command: `OMP_NUM_THREADS=1 hatch run python tools/bench/bench_autotune.py {' '.join(sys.argv[1:])}`",
        f"- space: stage 0-3 x micro-batch {args.mbs} x reduce_bucket_size {args.buckets} = {space} points "
        f"(allgather/prefetch buckets 5e8, overlap_comm on); GPT d_model {args.d_model}, 2 layers, seq 64; "
        f"samples/s: the engine's median step between optimizer steps {args.start} and {args.end} (the "
        f"confirm phase's runs: to step {confirm_window_end(args.start, args.end)}); each experiment is a "
        "fresh 2-rank launch",
        f"- tuner: model_based, tuner_early_stopping {args.early_stopping}, stage early stopping; grid: "
        "gridsearch, no early stopping; both with the confirm phase (top 3 re-measured); "
        f"{len(rounds)} rounds; picks re-measured {args.remeasure}x each, interleaved, steps "
        f"{args.start}-{args.remeasure_end}; this invocation {time.perf_counter() - began:.0f} s",
        "",
        *_search_rows(rounds, space),
        "",
        *_ratio_rows(rounds),
        "",
        f"- **throughput, tuner's pick / grid's pick (re-measured): median {med(ratios):.3f}, IQR "
        f"{_iqr(ratios)}** (target >= 0.95); per round: " + ", ".join(f"{v:.3f}" for v in ratios),
        f"- **wall time, tuner / grid (confirm phases included): median {med(walls):.3f}, IQR {_iqr(walls)}** "
        "(target <= 0.30); per round: " + ", ".join(f"{v:.3f}" for v in walls),
        "",
        "Wall times are dominated by the launches (process start, torch import, gloo setup), so the "
        "wall ratio tracks the ratio of launches. A ratio is only as good as the machine is quiet: "
        "compare the load averages.",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mbs", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--buckets", type=int, nargs="+", default=[20_000, 2_000_000])
    p.add_argument("--start", type=int, default=2)
    # a step of this model takes ~10-20 ms and a launch ~5 s: a 10-step window costs little and is
    # far steadier than DeepSpeed's default 2 (start 3, end 5)
    p.add_argument("--end", type=int, default=12)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--early_stopping", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--remeasure", type=int, default=3, help="launches per pick in the re-measurement")
    p.add_argument(
        "--remeasure_end",
        type=int,
        default=None,
        help="end_profile_step of the re-measurement (default: that of the confirm phase's runs)",
    )
    p.add_argument("--report_only", action="store_true", help="rewrite the report from --work's rounds.json")
    p.add_argument("--resume", action="store_true", help="keep the rounds saved in --work, run the rest")
    p.add_argument("--work", default="/tmp/bench_autotune")
    p.add_argument("--out", default=os.path.join(ROOT, "tools", "bench", "results", "bench_autotune.md"))
    args = p.parse_args()
    if args.remeasure_end is None:
        args.remeasure_end = confirm_window_end(args.start, args.end)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, GPTConfig, num_params

    # given to both searches, so neither spends a launch on the model information
    args.num_params = num_params(GPT(GPTConfig(seq_len=64, d_model=args.d_model, n_layers=2, n_heads=4)))
    began = time.perf_counter()
    saved = os.path.join(args.work, "rounds.json")
    rounds: list[dict] = []
    if (args.report_only or args.resume) and os.path.isfile(saved):
        with open(saved) as f:
            rounds = json.load(f)
    if not args.report_only:
        os.makedirs(args.work, exist_ok=True)
        for r in range(len(rounds), args.rounds):
            rounds.append(_round(args, r))
            with open(saved, "w") as f:  # kept for --report_only and --resume
                json.dump(rounds, f)
    lines = _report(args, rounds, began)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
