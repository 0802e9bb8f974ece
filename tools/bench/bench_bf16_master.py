"""bf16 master weights and optimizer states against fp32 masters: model-state bytes and loss.

DeepSpeed 0.18's memory mode (``bf16.bf16_master_weights_and_grads`` and
``bf16.bf16_optimizer_states``, See [Note: bf16 master weights] in
``zero_core/utils/master_dtype.py``) keeps masters, gradients and optimizer states in bf16.
This runs the examples/ GPT demo (``examples/train_gpt.py``'s ``main`` with
``examples/configs/stage3.json``, bf16, TensorBoard off) in both modes in one launch of
``--nproc`` ranks, on the same data:

1. model-state bytes per parameter, from ``engine.memory_breakdown()`` right after a backward
   (gradients alive, Adam's states made by an earlier step; Adam's per-tensor ``step`` scalars
   left out), beside the formula of the Note;
2. the loss curve of a ``--steps`` run (rank-averaged per step), the end-of-run loss (mean over
   the last ``--tail`` steps) of bf16 masters within 2% of fp32 masters' being the target.

Writes ``--out`` (markdown) and ``--plot`` (PNG).

    hatch run python tools/bench/bench_bf16_master.py --steps 200 \\
        --out tools/bench/results/bench_bf16_master.md --plot tools/bench/results/bench_bf16_master.png
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = {
    "fp32 masters": {"enabled": True},
    "bf16 masters + states": {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    },
}


def _config(stage: int, bf16: dict) -> dict:
    with open(os.path.join(ROOT, "examples", "configs", "stage3.json")) as f:
        cfg = json.load(f)
    cfg.pop("tensorboard", None)
    cfg["zero_optimization"]["stage"] = stage
    cfg["bf16"] = copy.deepcopy(bf16)
    return cfg


def _example():  # noqa: ANN202
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import gpt
    import train_gpt

    return gpt, train_gpt


def _memory(stage: int, bf16: dict) -> dict:
    """Bytes per category right after the second backward, and Adam's scalar bytes."""
    import zero_core
    from zero_core import comm

    gpt, train_gpt = _example()
    args = train_gpt.parse_args(["--zero_config", "unused"])
    torch.manual_seed(args.seed)
    model = gpt.GPT(gpt.GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers))
    n_params = gpt.num_params(model)
    engine = zero_core.initialize(model=model, config=_config(stage, bf16))[0]
    data = gpt.stdlib_corpus(200_000)
    rank, micro = comm.get_rank(), engine.train_micro_batch_size_per_gpu()
    breakdown: dict[str, int] = {}
    for step in range(2):
        start = (rank * 2 + step) * micro * args.seq_len
        w = data[start : start + micro * (args.seq_len + 1)].view(micro, args.seq_len + 1).long()
        engine.backward(engine(w[:, :-1], w[:, 1:]))
        breakdown = engine.memory_breakdown()
        engine.step()
    opt = engine.strategy.optimizer
    scalars = sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() == 0
    )
    engine.destroy()
    return {"breakdown": breakdown, "scalars": scalars, "params": n_params}


def _train(stage: int, bf16: dict, steps: int) -> list[float]:
    """``examples/train_gpt.py``'s main with the example's config in this mode; this rank's loss per step."""
    from zero_core import comm

    _, train_gpt = _example()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        if comm.get_rank() == 0:
            print(f"[bench_bf16_master] training {json.dumps(bf16)} for {steps} steps", flush=True)
        with open(path, "w") as f:
            json.dump(_config(stage, bf16), f)
        out = train_gpt.main(["--steps", str(steps), "--no_save", "--out_dir", tmp, "--zero_config", path])
    return out["losses"]


def rank_main(stage: int, steps: int) -> dict:
    return {
        "memory": {name: _memory(stage, bf16) for name, bf16 in MODES.items()},
        "losses": {name: _train(stage, bf16, steps) for name, bf16 in MODES.items()},
    }


def _bytes_table(memory: dict, stage: int, world: int) -> list[str]:
    from zero_core.utils.master_dtype import model_state_bytes_per_param

    lines = [
        "| mode | parameters | gradients | master weights | optimizer states | total | bytes/param | formula |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in memory.items():
        b = m["breakdown"]
        cats = [b.get(k, 0) for k in ("parameters", "gradients", "master_weights", "optimizer_states")]
        cats[3] -= m["scalars"]
        total = sum(cats)
        formula = model_state_bytes_per_param(stage, world, name != "fp32 masters")
        lines.append(
            f"| {name} | "
            + " | ".join(f"{c:,}" for c in cats)
            + f" | {total:,} | {total / m['params']:.3f} | "
            f"{formula:.3f} |"
        )
    return lines


def _plot(curves: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title("examples/ GPT, ZeRO stage 3, bf16: fp32 vs bf16 masters")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _report(res: list[dict], a: argparse.Namespace, took: float, argv: list[str]) -> tuple[str, dict]:
    world = len(res)
    curves = {
        name: [sum(r["losses"][name][i] for r in res) / world for i in range(a.steps)] for name in MODES
    }
    base, low = curves["fp32 masters"], curves["bf16 masters + states"]
    end = {name: sum(ys[-a.tail :]) / a.tail for name, ys in curves.items()}
    rel = end["bf16 masters + states"] / end["fp32 masters"] - 1
    lines = [
        "# bf16 master weights and optimizer states vs fp32 masters (examples/ GPT)",
        "",
        f"Command: `hatch run python tools/bench/bench_bf16_master.py {' '.join(argv)}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} "
        f"(shared with other jobs); torch {torch.__version__}, gloo, {world} ranks; commit {_commit()}; "
        f"{took:.0f} s for everything.",
        f"Run: `examples/train_gpt.py` with `examples/configs/stage3.json` (stage {a.stage}, AdamW lr 3e-3 "
        "with warmup and cosine decay, clipping 1.0; TensorBoard off), bf16 on, default model sizes; "
        "the two modes on the same data, one after the other in one launch.",
        "",
        "## Model-state bytes per parameter (rank 0, after a backward)",
        "",
        *_bytes_table(res[0]["memory"], a.stage, world),
        "",
        "Adam's per-tensor `step` scalars are left out; the formula is [Note: bf16 master weights]'s "
        "table (padding aside). In bf16 master mode the master is the bf16 shard itself (0 bytes of "
        "its own).",
        "",
        "## Loss",
        "",
        f"End-of-run loss (mean over the last {a.tail} steps): fp32 masters {end['fp32 masters']:.4f}, "
        f"bf16 masters {end['bf16 masters + states']:.4f}: **{rel * 100:+.2f}%** (target: within 2%). "
        f"Last step: {base[-1]:.4f} vs {low[-1]:.4f} ({(low[-1] / base[-1] - 1) * 100:+.2f}%).",
        "",
        f"![loss curves]({os.path.basename(a.plot)})" if a.plot else "",
        "",
        "| step | fp32 masters | bf16 masters + states |",
        "|---|---|---|",
    ]
    for i in range(a.log_every - 1, a.steps, a.log_every):
        lines.append(f"| {i + 1} | {base[i]:.4f} | {low[i]:.4f} ({(low[i] / base[i] - 1) * 100:+.2f}%) |")
    return "\n".join(lines) + "\n", {"curves": curves, "end": end, "relative": rel}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tail", type=int, default=20, help="steps averaged for the end-of-run loss")
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--out", default=None, help="markdown results file")
    p.add_argument("--plot", default=None, help="PNG of the two loss curves")
    a = p.parse_args(argv)
    if not 1 <= a.tail <= a.steps:
        p.error(f"--tail must be between 1 and --steps ({a.steps}), got {a.tail}")
    from zero_core.testing import run_multirank

    t0 = time.time()
    res = run_multirank(rank_main, a.nproc, args=(a.stage, a.steps), timeout=4 * 3600)
    text, summary = _report(res, a, time.time() - t0, argv)
    print(text)
    if a.plot:
        _plot(summary["curves"], a.plot)
    if a.out:
        from zero_core.checkpoint.atomic import atomic_write_text

        atomic_write_text(a.out, text)
    return summary


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
