"""CPU step time and host syncs per step before and after the sync removal of issue 22.

Before that work the step read device values on the host once per parameter tensor (a
``.cpu()`` per tensor when summing squared norms in ``stage_1_and_2.py``, ``stage3/strategy.py``
and ``data_parallel.py``, ``loss.item()`` on every backward); after it, the norm is one fused
device computation and the step reads the host at most once (see [Note: scalars stay on the
device in the step]). Those reads cost time on a CPU too (a dispatch and a copy per tensor), so
this measures both versions on a model of many small parameters, where the per-tensor cost
shows: ``LAYERS`` Linear(``DIM``, ``DIM``) layers (2 tensors each), 2 ranks, gloo, Adam,
gradient clipping on, stage 3's agreement checks off (they read the host by design, in both).

The two versions cannot share a process (both are ``zero_core``), so each runs in its own
worker process: ``--before`` (default: the main commit before the work, 84a1114) is unpacked
with ``git archive`` into a temporary directory and its packages' sources (all but zero-ops,
whose native build only the installed copy has) are put first on ``PYTHONPATH``; the after
side is this checkout. Workers alternate before/after for ``--passes`` passes (the machine is
shared and noisy); medians and interquartile ranges are pooled over ranks and passes.

Run: OMP_NUM_THREADS=1 hatch run python tools/bench/bench_host_syncs.py [--passes 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_env import cpu_model, git_commit
from host_syncs_column import host_syncs_per_step

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tools" / "bench" / "results" / "bench_host_syncs.md"
LAYERS, DIM, MICRO, STAGES = 64, 32, 4, (0, 1, 2, 3)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(DIM, DIM), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _stage(stage: int, steps: int) -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.zero.stage3 import set_collective_checks

    set_collective_checks(False)
    rank = comm.get_rank()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine = zero_core.initialize(model=_model(), config=cfg)[0]

    def step_fn(s: int) -> None:
        g = torch.Generator().manual_seed(100 * s + rank)
        x, y = torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, DIM, generator=g)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()

    times = []
    for s in range(steps + 2):
        comm.barrier()
        t = time.perf_counter()
        step_fn(s)
        if s >= 2:
            times.append(time.perf_counter() - t)
    syncs = host_syncs_per_step(step_fn, steps + 2)
    engine.destroy()
    return {"times": times, "syncs": syncs}


def _worker(steps: int) -> None:
    import zero_core
    from zero_core.testing import run_multirank

    out = {"zero_core": str(Path(zero_core.__file__).parent), "stages": {}}
    for stage in STAGES:
        res = run_multirank(_stage, 2, args=(stage, steps), timeout=900)
        out["stages"][stage] = {
            "times": [t for r in res for t in r["times"]],
            "syncs": max(r["syncs"] for r in res),
        }
    print("BENCH_JSON " + json.dumps(out))


def _run_worker(src: str | None, steps: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if src is not None:
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", "--steps", str(steps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            return json.loads(line[len("BENCH_JSON ") :])
    raise RuntimeError(f"worker (src={src}) failed, rc {proc.returncode}:\n{proc.stderr[-3000:]}")


def _iqr(t: list[float]) -> str:
    q = statistics.quantiles(t, n=4)
    return f"{q[0] * 1e3:.1f}-{q[2] * 1e3:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="84a1114", help="git revision of the 'before' side")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.steps < 2 or a.passes < 1:
        raise SystemExit("--steps must be >= 2 and --passes >= 1")
    if a.worker:
        _worker(a.steps)
        return
    before_rev = subprocess.run(
        ["git", "rev-parse", "--short", a.before], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="bench_host_syncs_")
    archive = subprocess.run(
        ["git", "archive", a.before, "packages"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    # every package of that commit (config sections are found through the installed packages' entry
    # points), except zero-ops, whose native build only the installed copy has
    before_src = os.pathsep.join(
        str(p) for p in sorted(Path(tmp, "packages").glob("*/src")) if p.parent.name != "zero-ops"
    )
    sides = {"before": before_src, "after": None}
    rows: dict[str, dict[int, dict]] = {k: {s: {"times": [], "syncs": 0} for s in STAGES} for k in sides}
    loads, where = [], {}
    t0 = time.perf_counter()
    for _ in range(a.passes):
        for side, src in sides.items():
            loads.append(os.getloadavg()[0])
            res = _run_worker(src, a.steps)
            where[side] = res["zero_core"]
            for stage, r in res["stages"].items():
                rows[side][int(stage)]["times"] += r["times"]
                rows[side][int(stage)]["syncs"] = max(rows[side][int(stage)]["syncs"], r["syncs"])
    loads.append(os.getloadavg()[0])
    wall = time.perf_counter() - t0
    lines = [
        "# bench_host_syncs: CPU step time and host syncs per step, before and after issue 22's sync removal",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}; shared with other jobs "
        "(loaded: quote the ratios, not the times)",
        f"- load average (1 min) before each worker: min {min(loads):.1f}, median {statistics.median(loads):.1f}, "
        f"max {max(loads):.1f} ({len(loads)} samples over {wall:.0f} s)",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- before: {before_rev} (git archive, zero_core from {where['before']}); after: "
        f"{git_commit('packages/zero-core', 'tools/bench/bench_host_syncs.py')} (zero_core from {where['after']})",
        f"- command: `OMP_NUM_THREADS=1 hatch run python tools/bench/bench_host_syncs.py --passes {a.passes} "
        f"--steps {a.steps}`",
        f"- model: {LAYERS} x (Linear({DIM}, {DIM}) + Tanh), {2 * LAYERS} parameter tensors; micro-batch {MICRO} per "
        "rank; 2 ranks, gloo; Adam; gradient_clipping 1.0; stage 3: persistence threshold 0, agreement checks off",
        f"- {a.passes} passes, before and after alternating, each a worker process running every stage in its own "
        f"pair of forked ranks; {a.steps} timed steps after 2 warm-up steps; times pooled over ranks and passes; "
        "host syncs counted on 2 extra untimed steps (tools/bench/host_syncs_column.py), max over ranks",
        "",
        "| stage | before: median step (ms) | IQR (ms) | after: median step (ms) | IQR (ms) | after / before "
        "| host syncs/step before | after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stage in STAGES:
        b, f = rows["before"][stage], rows["after"][stage]
        mb, mf = statistics.median(b["times"]), statistics.median(f["times"])
        lines.append(
            f"| {stage} | {mb * 1e3:.1f} | {_iqr(b['times'])} | {mf * 1e3:.1f} | {_iqr(f['times'])} "
            f"| {mf / mb:.2f} | {b['syncs']} | {f['syncs']} |"
        )
    text = "\n".join(lines) + "\n"
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
