"""Importing a DeepSpeed checkpoint: zero's converter vs DeepSpeed's own zero_to_fp32.py, same folder.

Run:  OMP_NUM_THREADS=1 python tools/bench/bench_from_deepspeed.py [--ds-python /work/dsvenv/bin/python]
      [--rounds 3] [--workdir DIR]

DeepSpeed (its own venv, ``DS_ACCELERATOR=cpu``, 2 ranks over gloo) trains the bench model
(24 x Linear(2048, 2048) = 100.7M parameters, fp32, torch Adam, one step) and saves a ZeRO-2 and
a ZeRO-3 checkpoint. Then, per checkpoint and round, in fresh processes and alternating order:

* zero: ``tools/from_deepspeed.py DS_DIR OUT`` (everything: fp32 masters, both Adam moments,
  counters; the zero checkpoint a run continues from), and the standalone ``zero_to_fp32.py`` the
  converter writes beside it, on that output (one fp32 state dict, what DeepSpeed's script gives);
* DeepSpeed: the ``zero_to_fp32.py`` DeepSpeed copied into the folder, ``--safe_serialization``
  (one fp32 state dict of the weights only: it skips the optimizer states).

Time is wall seconds of the process; peak RSS its VmHWM (resident pages, including the pages
of memory-mapped checkpoint files it touched). The outputs are checked: zero's fp32 state dict
must equal DeepSpeed's exactly. Writes tools/bench/results/bench_from_deepspeed.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

from bench_env import cpu_model, git_commit

WIDTH, DEPTH = 2048, 24
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_DS_WORKER = textwrap.dedent(
    """
    import os, sys, torch, deepspeed
    stage, out, width, depth = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "steps_per_print": 10**6,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(1, width, generator=torch.Generator().manual_seed(1 + engine.global_rank))
    engine.backward(engine(x).pow(2).mean()); engine.step()
    engine.save_checkpoint(out)
    """
)

_RSS_WRAPPER = (
    "import runpy, sys\n"
    "sys.argv = sys.argv[1:]\n"
    "try:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "except SystemExit as e:\n"
    "    if e.code:\n"
    "        raise\n"
    "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1]\n"
    "print('PEAK_RSS_KB', hwm, file=sys.stderr)\n"
)


def _run(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS (VmHWM, bytes) of the python script ``cmd`` in a fresh interpreter."""
    t0 = time.perf_counter()
    p = subprocess.run([cmd[0], "-c", _RSS_WRAPPER, *cmd[1:]], capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    m = re.search(r"PEAK_RSS_KB (\d+)", p.stderr)
    if p.returncode != 0 or m is None:
        raise RuntimeError(f"{cmd} failed (exit {p.returncode}): {p.stderr[-3000:]}")
    return dt, int(m.group(1)) * 1024


def _du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _make_checkpoint(ds_python: str, workdir: str, stage: int) -> str:
    script = os.path.join(workdir, "ds_worker.py")
    with open(script, "w") as f:
        f.write(_DS_WORKER)
    out = os.path.join(workdir, f"ds_stage{stage}")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [ds_python, "-m", "torch.distributed.run", "--nproc_per_node", "2", script, str(stage), out]
    p = subprocess.run([*cmd, str(WIDTH), str(DEPTH)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"DeepSpeed stage {stage} save failed: {p.stdout[-2000:]} {p.stderr[-3000:]}")
    return out


def _state_dict(path: str) -> dict:
    from safetensors.torch import load_file

    files = (
        [path]
        if os.path.isfile(path)
        else sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    )
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def _check_same(zero_out: str, ds_out: str) -> float:
    """Largest absolute difference between the two fp32 state dicts (must be 0: the same fp32 values)."""
    a, b = _state_dict(zero_out), _state_dict(ds_out)
    if set(a) != set(b):
        raise RuntimeError(f"different tensors: zero {sorted(a)[:4]}..., DeepSpeed {sorted(b)[:4]}...")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _round(ds: str, ds_python: str, workdir: str, order: list[str]) -> dict[str, tuple[float, int, int]]:
    """One round over the three conversions of ``ds`` in ``order``: {name: (seconds, peak RSS, bytes out)}."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ds_env = {**env, "DS_ACCELERATOR": "cpu"}
    zero_ckpt, zero_fp32, ds_fp32 = (os.path.join(workdir, n) for n in ("zero_ckpt", "zero_fp32", "ds_fp32"))
    res = {}
    for name in order:
        if name == "zero import":
            shutil.rmtree(zero_ckpt, ignore_errors=True)
            cmd = [sys.executable, os.path.join(ROOT, "tools", "from_deepspeed.py"), ds, zero_ckpt]
            res[name] = (*_run(cmd, env), _du(zero_ckpt))
        elif name == "zero to fp32":
            if not os.path.isdir(zero_ckpt):  # this round imported later: import first (untimed)
                _run([sys.executable, os.path.join(ROOT, "tools", "from_deepspeed.py"), ds, zero_ckpt], env)
            shutil.rmtree(zero_fp32, ignore_errors=True)
            cmd = [
                sys.executable,
                os.path.join(
                    zero_ckpt, "zero_to_fp32.py"
                ),  # the standalone copy, as DeepSpeed users run theirs
                zero_ckpt,
                zero_fp32 + ".safetensors",
            ]
            res[name] = (*_run(cmd, env), _du(zero_fp32 + ".safetensors"))
        else:
            shutil.rmtree(ds_fp32, ignore_errors=True)
            cmd = [ds_python, os.path.join(ds, "zero_to_fp32.py"), ds, ds_fp32, "--safe_serialization"]
            res[name] = (*_run(cmd, ds_env), _du(ds_fp32))
    return res


def _bench_stage(stage: int, args: argparse.Namespace, workdir: str) -> dict:
    print(f"stage {stage}: DeepSpeed saves the checkpoint (2 ranks) ...", flush=True)
    ds = _make_checkpoint(args.ds_python, workdir, stage)
    names = ["zero import", "zero to fp32", "DeepSpeed zero_to_fp32"]
    runs: dict[str, list[tuple[float, int, int]]] = {n: [] for n in names}
    ratios = []
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        res = _round(ds, args.ds_python, workdir, order)
        for n in names:
            runs[n].append(res[n])
        ratios.append(res["zero import"][0] / res["DeepSpeed zero_to_fp32"][0])
        print(
            f"stage {stage} round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} {res[n][0]:.2f} s" for n in names),
            flush=True,
        )
    diff = _check_same(os.path.join(workdir, "zero_fp32.safetensors"), os.path.join(workdir, "ds_fp32"))
    ds_bytes = _du(os.path.join(ds, open(os.path.join(ds, "latest")).read().strip()))
    shutil.rmtree(ds, ignore_errors=True)
    return {"runs": runs, "ratios": ratios, "diff": diff, "ds_bytes": ds_bytes}


def _fmt(xs: list[float], scale: float = 1.0, digits: int = 2) -> str:
    xs = sorted(x * scale for x in xs)
    return f"{statistics.median(xs):.{digits}f} [{xs[0]:.{digits}f}-{xs[-1]:.{digits}f}]"


def _report(results: dict[int, dict], args: argparse.Namespace, loads: list[float]) -> str:
    ds_version = (
        subprocess.run(
            [args.ds_python, "-c", "import deepspeed; print(deepspeed.__version__)"],
            capture_output=True,
            text=True,
            env={**os.environ, "DS_ACCELERATOR": "cpu"},
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    import torch

    lines = [
        "# Importing a DeepSpeed checkpoint: zero's converter vs DeepSpeed's zero_to_fp32.py",
        "",
        f"- machine: nproc {os.cpu_count()}, {cpu_model()}, {platform.platform()} (shared with other jobs: compare "
        "within this run)",
        f"- torch {torch.__version__}, python {platform.python_version()}, deepspeed {ds_version} (own venv, "
        f"DS_ACCELERATOR=cpu), commit {git_commit('packages/zero-core/src/zero_core/checkpoint', 'tools')}",
        f"- command: `OMP_NUM_THREADS=1 python tools/bench/bench_from_deepspeed.py --rounds {args.rounds}`",
        f"- model: {DEPTH} x Linear({WIDTH}, {WIDTH}) = 100.7M parameters, fp32, torch Adam, one step, saved by "
        "DeepSpeed on 2 ranks (gloo)",
        f"- {args.rounds} rounds, the three conversions in alternating order each round, each a fresh process "
        "reading the folder from the page cache; median [min-max]; 1-minute load average during the run: "
        f"{_fmt(loads, digits=1)}",
        "- peak RSS: the process's VmHWM (resident pages, memory-mapped checkpoint pages it touched included)",
        "",
        "| checkpoint | conversion | writes | time s | peak RSS MB | output MB |",
        "|---|---|---|---|---|---|",
    ]
    what = {
        "zero import": "zero checkpoint: fp32 masters + Adam moments + counters (resumable at any world size)",
        "zero to fp32": "the zero_to_fp32.py copied into the imported checkpoint: one fp32 state dict",
        "DeepSpeed zero_to_fp32": "DeepSpeed's zero_to_fp32.py --safe_serialization: one fp32 state dict",
    }
    for stage, res in results.items():
        for name, runs in res["runs"].items():
            lines.append(
                f"| ZeRO-{stage}, 2 ranks, {res['ds_bytes'] / 1e6:.0f} MB | {name} | {what[name]} | "
                f"{_fmt([r[0] for r in runs])} | {_fmt([r[1] for r in runs], 1e-6, 0)} | "
                f"{statistics.median(r[2] for r in runs) / 1e6:.0f} |"
            )
    lines += [
        "",
        "| checkpoint | zero import time / DeepSpeed zero_to_fp32 time, per round | peak RSS ratio | zero fp32 == DeepSpeed fp32 |",
        "|---|---|---|---|",
    ]
    for stage, res in results.items():
        rss = statistics.median(r[1] for r in res["runs"]["zero import"]) / statistics.median(
            r[1] for r in res["runs"]["DeepSpeed zero_to_fp32"]
        )
        lines.append(f"| ZeRO-{stage} | {_fmt(res['ratios'])} | {rss:.2f} | max abs diff {res['diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ds-python", default="/work/dsvenv/bin/python")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument(
        "--out", default=os.path.join(ROOT, "tools", "bench", "results", "bench_from_deepspeed.md")
    )
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="bench_from_ds_", dir=args.workdir)
    loads = []
    try:
        results = {}
        for stage in (2, 3):
            loads.append(os.getloadavg()[0])
            results[stage] = _bench_stage(stage, args, workdir)
            loads.append(os.getloadavg()[0])
        text = _report(results, args, loads)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
