"""ZeRO++ qwZ / qgZ convergence: the examples/ GPT's loss curve against plain stage 3.

Trains the examples/ GPT (small config) on the standard library's bytes with ZeRO stage 3, bf16,
on 4 ranks as 2 nodes x 2 (``ZERO_RANKS_PER_NODE=2``, so qgZ takes both of its hops), once plain
and once per switch (``zero_quantized_weights``, ``zero_quantized_gradients``, both), on the same
data, and compares the rank-averaged loss at every logged step (every ``--log_every``): the
ZeRO++ claim is that quantized communication leaves the curve within 2% of plain stage 3's.
Writes a markdown table (``--out``). The CI-sized check is ``tests/test_zeropp_gpt_convergence.py``.

    hatch run python tools/bench/zeropp_quantized_convergence.py --steps 200 \\
        --out tools/bench/results/zeropp_quantized_convergence.md
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = {
    "plain": {},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "qwZ+qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
}


def _gpt():
    spec = importlib.util.spec_from_file_location("zeropp_gpt", os.path.join(ROOT, "examples", "gpt.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["zeropp_gpt"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def train(
    q: dict, steps: int, log_every: int, micro: int, seq: int, d_model: int, layers: int
) -> list[float]:
    """Rank-averaged loss at steps log_every, 2 log_every, ... (same data for every variant)."""
    import zero_core
    from zero_core import comm

    gpt = _gpt()
    rank, world = comm.get_rank(), comm.get_world_size()
    data = gpt.stdlib_corpus(400_000)
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(d_model=d_model, n_layers=layers, n_heads=4, seq_len=seq))
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 2e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000, **q},
    }
    engine = zero_core.initialize(model=model, config=cfg)[0]
    logged = []
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step)
        starts = torch.randint(0, data.numel() - seq - 1, (world * micro,), generator=g)
        w = torch.stack([data[s : s + seq + 1] for s in starts[rank * micro : (rank + 1) * micro].tolist()])
        loss = engine(w[:, :-1], w[:, 1:])
        engine.backward(loss)
        engine.step()
        if step % log_every == 0:
            mean = loss.detach().float().clone()
            comm.all_reduce(mean)
            logged.append(float(mean) / world)
    return logged


def train_all(names: list[str], *args) -> dict[str, list[float]]:
    return {name: train(VARIANTS[name], *args) for name in names}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", default=None, help="markdown results file")
    a = p.parse_args(argv)
    from zero_core.testing import run_multirank

    t0 = time.time()
    args = (list(VARIANTS), a.steps, a.log_every, a.micro, a.seq, a.d_model, a.layers)
    res = run_multirank(train_all, 4, args=args, env={"ZERO_RANKS_PER_NODE": "2"}, timeout=7200)[0]
    took = time.time() - t0
    plain = res["plain"]
    worst = {k: max(abs(x - y) / y for x, y in zip(v, plain)) for k, v in res.items() if k != "plain"}
    lines = [
        "# ZeRO++ qwZ / qgZ: examples/ GPT loss against plain stage 3",
        "",
        f"Command: `hatch run python tools/bench/zeropp_quantized_convergence.py {' '.join(argv or sys.argv[1:])}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} "
        "(shared with other jobs); torch " + torch.__version__ + ", gloo, 4 ranks as 2 nodes x 2 "
        f"(ZERO_RANKS_PER_NODE=2); commit {_commit()}; {took:.0f} s for all runs.",
        f"Model: examples/gpt.py, d_model {a.d_model}, {a.layers} layers, seq {a.seq}, micro-batch {a.micro} "
        "per rank, bf16, Adam lr 2e-3, clipping 1.0, same data for every variant.",
        "",
        "| step | " + " | ".join(res) + " |",
        "|---|" + "---|" * len(res),
    ]
    for i, _ in enumerate(plain):
        row = [
            f"{res[k][i]:.4f}" + ("" if k == "plain" else f" ({(res[k][i] / plain[i] - 1) * 100:+.2f}%)")
            for k in res
        ]
        lines.append(f"| {(i + 1) * a.log_every} | " + " | ".join(row) + " |")
    lines += [
        "",
        "Largest deviation from plain stage 3 at a logged step: "
        + ", ".join(f"{k} {v * 100:.2f}%" for k, v in worst.items())
        + " (target: under 2%).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        from zero_core.checkpoint.atomic import atomic_write_text

        atomic_write_text(a.out, text)
    return {"losses": res, "worst": worst}


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
