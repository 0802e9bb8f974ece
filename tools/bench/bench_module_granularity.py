"""Stage 3 with ``module_granularity_threshold``: hooks, collectives and step time, off vs on.

A model of many small modules (an embedding, ``--blocks`` LayerNorm+Linear blocks of width
``--width``, a head) trained with ZeRO stage 3 on ``--nproc`` ranks, with the threshold off and
set to the blocks' granularity (so each block is fetched and released as one unit; See
[Note: module granularity threshold]), each with the default ``prefetch_bucket_size`` and with
prefetching off. Every parameter is partitioned (``param_persistence_threshold`` 0: otherwise
these small layers would all be persistent and nothing would be fetched). Per variant: module
hooks fired per step (forward pre and post hooks, backward pre-hooks: the coordinator's fetch
events), all-gathers and reduce-scatters per step (comms logger, one counted step after the
timed ones), and step time; the variants take turns in one launch and the ratio on/off is the
median of per-pass ratios (See [Note: interleaved step-time ratios] in ``_timing.py``).

    hatch run python tools/bench/bench_module_granularity.py \\
        --out tools/bench/results/bench_module_granularity.md
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB, SEQ, MICRO = 1024, 16, 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))


class ManySmall(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), y.flatten())


def _variants(threshold: int) -> dict[str, dict]:
    return {
        "off": {"module_granularity_threshold": 0},
        "on": {"module_granularity_threshold": threshold},
        "off, no prefetch": {"module_granularity_threshold": 0, "stage3_prefetch_bucket_size": 0},
        "on, no prefetch": {"module_granularity_threshold": threshold, "stage3_prefetch_bucket_size": 0},
    }


def _engine(blocks: int, width: int, zero: dict):  # noqa: ANN202
    import zero_core

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }
    return zero_core.initialize(model=ManySmall(blocks, width), config=cfg)[0]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    from zero_core import comm

    g = torch.Generator().manual_seed(1000 * step + comm.get_rank())
    ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _step(engine, clock: _timing.PhaseClock, i: int) -> None:  # noqa: ANN001
    x, y = _batch(i)
    with clock.phase("forward"):
        loss = engine(x, y)
    with clock.phase("backward"):
        engine.backward(loss)
    with clock.phase("step"):
        engine.step()


def _counts(engine, i: int) -> dict[str, float]:  # noqa: ANN001
    from zero_core import comm

    comm.comms_logger.enable()
    comm.comms_logger.reset()
    _step(engine, _timing.PhaseClock(), i)
    out = {op: comm.comms_logger.count_for(op) for op in ("all_gather_into_tensor", "reduce_scatter_tensor")}
    comm.comms_logger.disable()
    trace = engine.strategy.coordinator.traces[(True, True)]
    fwd = sum(1 for _, phase in trace if phase == "forward")
    out["hooks"] = 2 * fwd + (len(trace) - fwd)  # pre + post per forward fetch, one pre per backward fetch
    out["leaves"] = len(engine.strategy.granularity_leaves)
    return out


def rank_main(blocks: int, width: int, threshold: int, passes: int, steps: int) -> dict:
    from zero_core import comm

    engines = {name: _engine(blocks, width, zero) for name, zero in _variants(threshold).items()}
    fns = {name: (lambda c, i, e=e: _step(e, c, i)) for name, e in engines.items()}
    if comm.get_rank() == 0:
        print(
            f"[bench_module_granularity] {len(engines)} variants x {passes} passes x {steps} steps",
            flush=True,
        )
    records = _timing.interleave(fns, passes, steps, comm.barrier)
    counts = {name: _counts(e, 10**6) for name, e in engines.items()}
    return {"records": records, "counts": counts}


def _threshold(blocks: int, width: int) -> tuple[int, int]:
    """The blocks' granularity (the threshold used) and the whole model's."""
    from zero_core.zero.stage3.module_granularity import granularities

    model = ManySmall(blocks, width)
    sizes = granularities(model)
    return sizes[id(model.blocks[0])], sizes[id(model)]


def _report(res: list[dict], a: argparse.Namespace, threshold: int, root: int, took: float, argv) -> str:  # noqa: ANN001
    merged = _timing.merge_ranks([r["records"] for r in res])
    counts = res[0]["counts"]
    lines = [
        "# module_granularity_threshold: hooks, collectives and step time (stage 3)",
        "",
        f"Command: `hatch run python tools/bench/bench_module_granularity.py {' '.join(argv)}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} "
        f"(shared with other jobs: timings are noisy, the ratios are interleaved); torch {torch.__version__}, "
        f"gloo, {a.nproc} ranks; commit {_commit()}; {took:.0f} s.",
        f"Model: Embedding({VOCAB}, {a.width}), {a.blocks} x (LayerNorm({a.width}) + Linear({a.width}, {a.width})), "
        f"Linear({a.width}, {VOCAB}); micro-batch {MICRO} x {SEQ} tokens per rank, Adam, fp32, "
        "param_persistence_threshold 0. Threshold "
        f"{threshold} (a block's granularity; the whole model's is {root}, so blocks are chosen, not the model). "
        f"{a.passes} passes x {a.steps} steps per variant, interleaved, after one warm-up step each.",
        "",
        "| variant | leaves | module hooks fired / step | all-gathers / step | reduce-scatters / step | "
        "step wall, ms median (IQR) | step CPU, ms median (IQR) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in counts.items():
        wall = _timing.fmt_iqr(_timing.step_quartiles(merged[name], "wall"), 1e3, 1)
        cpu = _timing.fmt_iqr(_timing.step_quartiles(merged[name], "cpu"), 1e3, 1)
        lines.append(
            f"| {name} | {c['leaves']} | {c['hooks']} | {c['all_gather_into_tensor']} | "
            f"{c['reduce_scatter_tensor']} | {wall} | {cpu} |"
        )
    lines += [
        "",
        "| on / off | hooks | all-gathers | wall ratio, median (IQR) | CPU ratio, median (IQR) |",
        "|---|---|---|---|---|",
    ]
    for on, off in (("on", "off"), ("on, no prefetch", "off, no prefetch")):
        hooks = counts[on]["hooks"] / counts[off]["hooks"]
        gathers = counts[on]["all_gather_into_tensor"] / max(counts[off]["all_gather_into_tensor"], 1)
        wall = _timing.fmt_iqr(_timing.ratio_quartiles(merged[on], merged[off], "wall"))
        cpu = _timing.fmt_iqr(_timing.ratio_quartiles(merged[on], merged[off], "cpu"))
        lines.append(f"| {on} / {off} | {hooks:.2f} | {gathers:.2f} | {wall} | {cpu} |")
    lines += [
        "",
        "With prefetching (the default 5e7-element bucket) the coordinator already gathers many upcoming "
        "modules per all-gather, so the threshold mostly saves hooks and their host work; without it, one "
        "all-gather per fetched module, and the threshold halves them. Reduce-scatters are bucketed by "
        "`reduce_bucket_size` either way.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=200)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None, help="markdown results file")
    a = p.parse_args(argv)
    from zero_core.testing import run_multirank

    threshold, root = _threshold(a.blocks, a.width)
    if root <= threshold:
        p.error(f"the whole model's granularity ({root}) is not above the blocks' ({threshold}): raise VOCAB")
    t0 = time.time()
    args = (a.blocks, a.width, threshold, a.passes, a.steps)
    res = run_multirank(rank_main, a.nproc, args=args, timeout=3600)
    text = _report(res, a, threshold, root, time.time() - t0, argv)
    print(text)
    if a.out:
        from zero_core.checkpoint.atomic import atomic_write_text

        atomic_write_text(a.out, text)
    return text


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
