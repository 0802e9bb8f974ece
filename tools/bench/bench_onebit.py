"""1-bit Adam, 0/1 Adam and 1-bit LAMB against Adam/LAMB with a DDP-style dense all-reduce.

Three measurements, all with zero's stage-0 engine (whose bucketed all-reduce overlapped with
backward is torch DDP's scheme, 1.00x DDP's step time in bench_stage0.md) over gloo:

1. Convergence (2 ranks): examples/gpt.py's GPT at a small size (d_model 64, 2 layers, seq 64)
   on the Python standard library's bytes, 300 steps, ``freeze_step`` 50 (0/1 Adam:
   ``var_freeze_step`` 50, local steps growing to 4). The loss is averaged over the ranks
   every step; "final loss" is the mean of the last 20 steps. The papers report no loss in
   accuracy; the check is a final loss at most 3% above the dense optimizer's (a lower one is no
   loss of accuracy). Curves in a PNG.
2. Wire and step time after the freeze (2 and 4 ranks): a larger GPT (d_model 256, 4 layers,
   seq 128), every optimizer in the same launch, taking turns each round. Bytes per step are
   what the comms logger recorded for the step (see [Note: what the comms logger counts]);
   step time is forward + backward + step on rank 0, median and [min, max].
3. The exchange alone: ``compressed_all_reduce`` vs ``all_reduce`` of the same fp32 tensor
   (the GPT's parameter count), interleaved, median and [min, max] over the repetitions.

Run: OMP_NUM_THREADS=1 hatch run python tools/bench/bench_onebit.py [--steps 300] [--rounds 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_env import cpu_model, git_commit

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_onebit_gpt", ROOT / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
sys.modules["bench_onebit_gpt"] = gpt  # dataclasses look their module up
_spec.loader.exec_module(gpt)

FREEZE = 50
SMALL = dict(d_model=64, n_layers=2, n_heads=4, seq_len=64)
LARGE = dict(d_model=256, n_layers=4, n_heads=4, seq_len=128)


def optimizers(adam_lr: float, lamb_lr: float, freeze: int) -> list[tuple[str, str, dict]]:
    """(label, config type, params): the dense baselines first."""
    zo = {"var_freeze_step": freeze, "local_step_scaler": 50, "local_step_clipper": 4}
    return [
        ("Adam (dense all-reduce)", "Adam", {"lr": adam_lr}),
        ("1-bit Adam", "OneBitAdam", {"lr": adam_lr, "freeze_step": freeze}),
        ("0/1 Adam", "ZeroOneAdam", {"lr": adam_lr, **zo}),
        ("LAMB (dense all-reduce)", "Lamb", {"lr": lamb_lr}),
        ("1-bit LAMB", "OneBitLamb", {"lr": lamb_lr, "freeze_step": freeze}),
    ]


def _engine(size: dict, opt_type: str, params: dict, micro: int):
    import zero_core

    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(**size))
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "steps_per_print": 10**9,
        "optimizer": {"type": opt_type, "params": params},
    }
    return zero_core.initialize(model=model, config=cfg)[0]


def _batch(data: torch.Tensor, step: int, rank: int, world: int, micro: int, seq: int):
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, data.numel() - seq - 1, (world * micro,), generator=g)[
        rank * micro : (rank + 1) * micro
    ]
    w = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).long()
    return w[:, :-1], w[:, 1:]


def _convergence(steps: int, adam_lr: float, lamb_lr: float) -> dict:
    from zero_core import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    data = gpt.stdlib_corpus(1_000_000)
    curves = {}
    for label, opt_type, params in optimizers(adam_lr, lamb_lr, FREEZE):
        engine = _engine(SMALL, opt_type, params, micro=8)
        losses = []
        for step in range(steps):
            x, y = _batch(data, step, rank, world, 8, SMALL["seq_len"])
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            comm.all_reduce(mean)
            losses.append(float(mean) / world)
        curves[label] = losses
    return curves


def _wire(rounds: int, per_round: int) -> dict:
    from zero_core import comm
    from zero_core.comm import comms_logger

    rank, world = comm.get_rank(), comm.get_world_size()
    data = gpt.stdlib_corpus(1_000_000)
    runs = {label: _engine(LARGE, t, p, micro=4) for label, t, p in optimizers(1e-4, 1e-3, 3)}
    seq = LARGE["seq_len"]
    step_no = {label: 0 for label in runs}

    def one(label: str, logged: bool) -> float:
        engine = runs[label]
        x, y = _batch(data, step_no[label], rank, world, 4, seq)
        step_no[label] += 1
        if logged:
            comms_logger.reset()
            comms_logger.enable()
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        elapsed = time.perf_counter() - start
        comms_logger.disable()
        return elapsed

    for label in runs:  # through the freeze (3 steps) plus one compressed step
        for _ in range(4):
            one(label, False)
    wire = {}
    for label in runs:
        one(label, True)
        wire[label] = {op: s.bytes for (op, _), s in comms_logger.summary().items()}
    times = {label: [] for label in runs}
    for _ in range(rounds):
        for label in runs:
            for _ in range(per_round):
                times[label].append(one(label, False))
    psi = sum(p.numel() for p in runs["1-bit Adam"].module.parameters())
    return {"times": times, "wire": wire, "psi": psi, "exchange": _exchange(psi, 2 * rounds)}


def _exchange(numel: int, reps: int) -> dict:
    from zero_core import comm

    n = comm.get_world_size()
    padded = comm.padded_numel(numel, n)
    x = torch.randn(padded, generator=torch.Generator().manual_seed(comm.get_rank()))
    worker, server = torch.zeros(padded), torch.zeros(padded // n)
    out = {"dense all_reduce": [], "compressed_all_reduce": []}
    for _ in range(reps + 1):
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(x[:numel].clone())
        t1 = time.perf_counter()
        comm.barrier()
        t2 = time.perf_counter()
        comm.compressed_all_reduce(x.clone(), worker, server)
        t3 = time.perf_counter()
        out["dense all_reduce"].append(t1 - t0)
        out["compressed_all_reduce"].append(t3 - t2)
    return {k: v[1:] for k, v in out.items()}  # the first repetition warms up


def _ms(values: list[float]) -> str:
    ms = [1000 * v for v in values]
    return f"{statistics.median(ms):.1f} [{min(ms):.1f}, {max(ms):.1f}]"


def _plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, losses in curves.items():
        smooth, ema = [], losses[0]
        for v in losses:
            ema = 0.9 * ema + 0.1 * v
            smooth.append(ema)
        ax.plot(smooth, label=label, linestyle="--" if "dense" in label else "-")
    ax.axvline(FREEZE, color="grey", linewidth=0.8)
    ax.set_xlabel("step (freeze at the grey line)")
    ax.set_ylabel("training loss, mean over 2 ranks (EMA 0.9)")
    ax.set_title("examples/gpt.py GPT (d_model 64, 2 layers), 2 ranks, gloo")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _convergence_lines(curves: dict, steps: int) -> list[str]:
    final = {label: statistics.mean(v[-20:]) for label, v in curves.items()}
    lines = [
        "| optimizer | final loss (mean of last 20 steps) | vs its dense baseline | at most 3% above it |",
        "|---|---|---|---|",
    ]
    for label, value in final.items():
        base = final["LAMB (dense all-reduce)" if "LAMB" in label else "Adam (dense all-reduce)"]
        ratio = value / base
        lines.append(f"| {label} | {value:.4f} | {ratio:.4f} | {'yes' if ratio <= 1.03 else 'NO'} |")
    return lines


def _wire_lines(world: int, result: dict) -> list[str]:
    psi, times, wire = result["psi"], result["times"], result["wire"]
    dense_time = statistics.median(times["Adam (dense all-reduce)"])
    lines = [
        f"### {world} ranks ({psi / 1e6:.2f}M parameters; dense fp32 all-reduce of them: {4 * psi:,} bytes)",
        "",
        "| optimizer | bytes per step after the freeze (by op) | vs dense fp32 | step ms median [min, max] "
        "| step time vs Adam |",
        "|---|---|---|---|---|",
    ]
    for label, t in times.items():
        ops = wire[label]
        total = sum(ops.values())
        by_op = ", ".join(f"{op} {b:,}" for op, b in sorted(ops.items()))
        lines.append(
            f"| {label} | {total:,} ({by_op}) | 1/{4 * psi / max(total, 1):.1f} | {_ms(t)} "
            f"| {statistics.median(t) / dense_time:.3f} |"
        )
    ex = result["exchange"]
    dense, comp = statistics.median(ex["dense all_reduce"]), statistics.median(ex["compressed_all_reduce"])
    lines += [
        "",
        f"Exchange of one {psi:,}-element fp32 tensor: dense `all_reduce` {_ms(ex['dense all_reduce'])} ms, "
        f"`compressed_all_reduce` {_ms(ex['compressed_all_reduce'])} ms (ratio {comp / dense:.3f}).",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="convergence run length")
    p.add_argument("--rounds", type=int, default=4, help="timed rounds (each: 2 steps of every optimizer)")
    p.add_argument("--adam_lr", type=float, default=2e-3)
    p.add_argument("--lamb_lr", type=float, default=2e-2)
    p.add_argument("--out", default=str(ROOT / "tools" / "bench" / "results" / "bench_onebit.md"))
    args = p.parse_args(argv)
    if args.steps <= FREEZE or args.rounds < 1:
        raise SystemExit(f"bench_onebit: need --steps > {FREEZE} and --rounds >= 1")
    from zero_core.testing import run_multirank

    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    curves = run_multirank(_convergence, 2, args=(args.steps, args.adam_lr, args.lamb_lr), timeout=1200)[0]
    wire = {w: run_multirank(_wire, w, args=(args.rounds, 2), timeout=1200)[0] for w in (2, 4)}
    total = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_name(out.stem + "_loss.png")
    _plot(curves, png)
    lines = [
        "# bench_onebit: 1-bit Adam, 0/1 Adam, 1-bit LAMB vs dense Adam / LAMB (gloo, CPU)",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.system()} {platform.release()}; shared with "
        "other jobs (compare ratios within this file, not absolute times); 1-minute load average "
        f"{load_before:.1f} at start, {load_after:.1f} at end; 4 ranks time-share the cores",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- git commit: {git_commit('packages/zero-core/src', 'packages/zero-ops/src', 'tools/bench/bench_onebit.py')}",
        f"- command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} hatch run python "
        f"tools/bench/bench_onebit.py --steps {args.steps} --rounds {args.rounds} --adam_lr {args.adam_lr} "
        f"--lamb_lr {args.lamb_lr}`; bench wall time {total:.0f} s",
        "- baselines: zero's stage-0 engine with `Adam` (torch AdamW) / `Lamb`: bucketed fp32 gradient "
        "all-reduce overlapped with backward, torch DDP's scheme",
        "",
        f"## Convergence: {args.steps} steps, freeze_step {FREEZE}, 2 ranks x micro-batch 8 x seq 64",
        "",
        f"Adam lr {args.adam_lr}, LAMB lr {args.lamb_lr}, constant; 0/1 Adam: var_freeze_step {FREEZE}, "
        "local_step_scaler 50, local_step_clipper 4. Curves: "
        f"[{png.name}]({png.name}).",
        "",
        *_convergence_lines(curves, args.steps),
        "",
        f"## Wire and step time after the freeze ({2 * args.rounds} timed steps per optimizer, interleaved)",
        "",
        "GPT d_model 256, 4 layers, seq 128, micro-batch 4 per rank; freeze_step 3 (0/1 Adam: "
        "var_freeze_step 3, so its steps here are local steps synchronised every 1-2 steps).",
        "",
    ]
    for w, result in wire.items():
        lines += _wire_lines(w, result)
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
