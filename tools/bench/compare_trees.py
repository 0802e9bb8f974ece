"""Step time of ZeRO stages 0-3 at two git revisions, run alternately in one launch (2 ranks, gloo, CPU).

[Note: before/after step-time comparison]
A change that should not slow the step (a refactoring, a consolidation) is checked by running
the *same* step loop on the code before and after it, close together in time, so that the
machine's load hits both alike. Both revisions are exported with ``git archive`` into temporary
directories; the two can not share a Python process (one ``zero_core`` per process), so each
round launches one worker per tree, the tree's ``packages/*/src`` first on ``PYTHONPATH`` (the
worker checks that ``zero_core`` came from there). Rounds alternate the order (before, after;
then after, before; ...) so a drift of the load over time favours neither. Each worker forks
``--world`` ranks, builds every variant in turn (stages 0/1/2 on bench_zero12's GPT in fp32,
stage 3 on bench_zero3's GPT in fp32 and bf16, the same configs as those benchmarks), runs one
warm-up step and ``--steps`` timed steps of each, and records per step the wall time and the
rank's process CPU time (all its threads, gloo's included). A round gives, per variant, the
median step of each tree (over steps and ranks) and their ratio after/before; the table gives
the median and interquartile range of those per-round ratios (``--rounds`` >= 5 for a figure
worth quoting), the per-tree medians, and the load average sampled at every launch.
The model is this script's own ``examples/gpt.py`` for both trees, so only the library differs.

Run: OMP_NUM_THREADS=1 .venv/bin/python tools/bench/compare_trees.py --before REV --after REV
     [--rounds 5] [--steps 3] [--variants stage0,stage1,stage2,stage3-fp32,stage3-bf16] [--tiny]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _timing
from bench_env import cpu_model

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tools" / "bench" / "results" / "bench_seams_issue24.md"
VARIANTS = ("stage0", "stage1", "stage2", "stage3-fp32", "stage3-bf16")
MICRO = 4
_RESULT = "COMPARE_TREES_RESULT "


# -- the worker: one tree, every variant, in forked ranks -----------------------------------------
def _gpt(stage3: bool, tiny: bool):
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("bench_gpt", ROOT / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpt"] = gpt  # dataclasses look their module up
    spec.loader.exec_module(gpt)
    torch.manual_seed(0)
    if tiny:
        return gpt.GPT(gpt.GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32)), 32
    if stage3:  # bench_zero3's model
        return gpt.GPT(gpt.GPTConfig(d_model=512, n_layers=6, n_heads=8, seq_len=128)), 128
    return gpt.GPT(gpt.GPTConfig(d_model=256, n_layers=4, n_heads=4, seq_len=128)), 128  # bench_zero12's


def _config(variant: str) -> dict:
    """bench_zero12's (stages 0-2) and bench_zero3's (stage 3) engine configs."""
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}},
    }
    if variant.startswith("stage3"):
        cfg["zero_optimization"] = {
            "stage": 3,
            "reduce_bucket_size": 5_000_000,
            "prefetch_bucket_size": 5_000_000,
            "param_persistence_threshold": 100_000,
            "overlap_comm": True,
        }
        if variant.endswith("bf16"):
            cfg["bf16"] = {"enabled": True}
    else:
        bucket = 50_000_000
        cfg["zero_optimization"] = {
            "stage": int(variant[-1]),
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "overlap_comm": True,
        }
    return cfg


def _rank_body(variants: list[str], steps: int, tiny: bool) -> dict:
    """In one rank: every variant in turn, one warm-up step then ``steps`` timed (wall, CPU) steps."""
    import torch
    import torch.distributed as dist
    import zero_core

    rank = dist.get_rank()
    out = {}
    for variant in variants:
        model, seq = _gpt(variant.startswith("stage3"), tiny)
        engine = zero_core.initialize(model=model, config=_config(variant))[0]
        times = []
        for s in range(steps + 1):
            g = torch.Generator().manual_seed(s * 100 + rank)
            x = torch.randint(0, 256, (MICRO, seq + 1), generator=g)
            w, c = time.perf_counter(), time.process_time()
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            if s > 0:  # step 0 is the warm-up
                times.append((time.perf_counter() - w, time.process_time() - c))
        destroy = getattr(engine, "destroy", None)  # older trees may lack it
        if destroy is not None:
            destroy()
        del engine, model
        gc.collect()
        out[variant] = times
    return out


def _worker(tree: str, variants: list[str], steps: int, world: int, tiny: bool) -> None:
    import zero_core
    from zero_core.testing import run_multirank

    src = Path(zero_core.__file__).resolve()
    if not src.is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"compare_trees worker: zero_core was imported from {src}, not from the tree {tree}")
    per_rank = run_multirank(_rank_body, world, args=(variants, steps, tiny), timeout=3600)
    print(_RESULT + json.dumps(per_rank))


# -- the driver: export, alternate, summarise --------------------------------------------------------
def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _export(rev: str, dest: Path) -> None:
    """``git archive`` of the revision's ``packages`` into ``dest``."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "packages"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def _launch(tree: Path, args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """One worker on ``tree``: per variant, the (wall, CPU) steps of every rank."""
    srcs = sorted(str(p) for p in (tree / "packages").glob("*/src"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*srcs, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(tree), "--variants", args.variants]
    cmd += ["--steps", str(args.steps), "--world", str(args.world)] + (["--tiny"] if args.tiny else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(tree))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(
            f"compare_trees: the worker on {tree} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    per_rank = json.loads(lines[-1][len(_RESULT) :])
    return {v: [t for r in per_rank for t in r[v]] for v in per_rank[0]}


def _run_rounds(trees: dict[str, Path], args: argparse.Namespace, load: _timing.LoadLog) -> list[dict]:
    rounds = []
    for k in range(args.rounds):
        order = ["before", "after"] if k % 2 == 0 else ["after", "before"]
        got = {}
        for side in order:
            got[side] = _launch(trees[side], args)
            load.sample()
        rounds.append(got)
        print(f"round {k + 1}/{args.rounds} done ({' then '.join(order)})", flush=True)
    return rounds


def _table(rounds: list[dict], variants: list[str]) -> list[str]:
    lines = [
        "| variant | before wall ms | after wall ms | wall after/before, median (IQR) "
        "| before CPU ms | after CPU ms | CPU after/before, median (IQR) |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in variants:
        cells = [v]
        ratio = {}
        for i, key in enumerate(("wall", "cpu")):
            med = {s: [statistics.median(t[i] for t in r[s][v]) for r in rounds] for s in ("before", "after")}
            ratio[key] = [a / b for a, b in zip(med["after"], med["before"])]
            cells += [
                f"{statistics.median(med['before']) * 1e3:.0f}",
                f"{statistics.median(med['after']) * 1e3:.0f}",
            ]
            cells.append(_timing.fmt_iqr(_timing.quartiles(ratio[key])))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _header(args: argparse.Namespace, revs: dict[str, str], load: _timing.LoadLog, wall: float) -> list[str]:
    import torch

    def describe(side: str) -> str:
        return f"{revs[side]} ({_git('log', '-1', '--format=%s', revs[side])[:100]})"

    size = (
        "tiny GPT (d_model 64, 2 layers, seq 32) for every variant"
        if args.tiny
        else (
            "stages 0-2: bench_zero12's GPT (d_model 256, 4 layers, seq 128, fp32, buckets 50,000,000, overlap_comm); "
            "stage 3: bench_zero3's GPT (d_model 512, 6 layers, seq 128) and its zero_optimization"
        )
    )
    return [
        "# Step time of ZeRO stages 0-3 before and after a change (CPU, gloo, one launch of compare_trees.py)",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- load: {load.describe()}",
        f"- before: {describe('before')}",
        f"- after: {describe('after')}",
        f"- command: `OMP_NUM_THREADS=1 .venv/bin/python tools/bench/compare_trees.py --before {args.before} "
        f"--after {args.after} --rounds {args.rounds} --steps {args.steps}"
        f"{' --tiny' if args.tiny else ''}` (script at {_git('rev-parse', '--short', 'HEAD')})",
        f"- model: {size}; micro-batch {MICRO} per rank; Adam lr 1e-4; no clipping; {args.world} ranks",
        f"- method: [Note: before/after step-time comparison] in tools/bench/compare_trees.py; {args.rounds} rounds, "
        f"the trees alternating; 1 warm-up + {args.steps} timed steps per variant per launch; CPU = process CPU "
        "time of a rank (all its threads); per-tree columns: median over rounds of each round's median step",
        f"- benchmark wall time: {wall:.0f} s",
        *(
            [
                "- **--tiny: an end-to-end check of this tool, not a step-time figure** (a model this small "
                "times Python and launch overheads; quote only a full-size run on a quiet machine)"
            ]
            if args.tiny
            else []
        ),
        "",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="main", help="git revision of the code before the change")
    ap.add_argument("--after", default="HEAD", help="git revision of the code after it (commit it first)")
    ap.add_argument("--rounds", type=int, default=5, help="launches per tree, alternating (>= 5 to quote)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per launch")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a tiny model, to check the tool end to end")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        ap.error(f"--variants: unknown {bad or 'empty list'}; choose from {', '.join(VARIANTS)}")
    if args.rounds < 1 or args.steps < 1 or args.world < 2:
        ap.error("--rounds and --steps must be >= 1 and --world >= 2")
    if args.worker is not None:
        _worker(args.worker, variants, args.steps, args.world, args.tiny)
        return
    revs = {"before": _git("rev-parse", args.before), "after": _git("rev-parse", args.after)}
    start = time.perf_counter()
    load = _timing.LoadLog()
    with tempfile.TemporaryDirectory(prefix="compare_trees_") as tmp:
        trees = {side: Path(tmp) / side for side in revs}
        for side, rev in revs.items():
            _export(rev, trees[side])
        rounds = _run_rounds(trees, args, load)
    lines = [*_header(args, revs, load, time.perf_counter() - start), *_table(rounds, variants), ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
