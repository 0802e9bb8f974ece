"""Pipeline bubble and throughput: zero_pipe 1F1B / interleaved vs theory and torch.distributed.pipelining.

Each stage holds equal Linear+tanh blocks. The engine records (kind, chunk, start, end) of every
forward/backward; per batch, the idle fraction of a stage is 1 - busy / (batch span over all
stages) (CLOCK_MONOTONIC is shared by the processes). Theory for equal stages: 1F1B
(p-1)/(m+p-1), interleaved with c chunks (p-1)/(c*m+p-1).

    OMP_NUM_THREADS=1 python tools/bench/bench_pipe.py [--out tools/bench/results/bench_pipe.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import torch
from torch import nn

DIM, MB, BLOCKS_PER_STAGE, BATCHES, WARMUP = 384, 64, 4, 6, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _zero_pipe_rank(stages, m, chunks):
    from zero_pipe import LayerSpec, PipelineEngine, PipelineModule

    torch.set_num_threads(1)
    layers = [LayerSpec(Block) for _ in range(BLOCKS_PER_STAGE * stages)]
    model = PipelineModule(
        layers, num_stages=stages, loss_fn=_loss, partition_method="uniform", num_chunks=chunks
    )
    engine = PipelineEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-3),
        {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": m},
    )
    data = [(torch.randn(MB, DIM), torch.randn(MB, DIM)) for _ in range(m)]
    traces, walls = [], []
    for b in range(WARMUP + BATCHES):
        engine.trace = []
        torch.distributed.barrier()
        t0 = time.perf_counter()
        engine.train_batch(iter(data))
        walls.append(time.perf_counter() - t0)
        if b >= WARMUP:
            traces.append(engine.trace)
    return traces, walls[WARMUP:]


def _torch_rank(stages, m, schedule_name):
    from torch.distributed import pipelining as pp

    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    chunks = 2 if schedule_name == "ScheduleInterleaved1F1B" else 1
    total = BLOCKS_PER_STAGE * stages
    per = total // (stages * chunks)
    stage_objs = []
    for c in range(chunks):
        v = c * stages + rank
        mod = nn.Sequential(*[Block() for _ in range(per)])
        stage_objs.append(pp.PipelineStage(mod, v, stages * chunks, torch.device("cpu")))
    cls = getattr(pp, schedule_name)
    sched = cls(stage_objs if chunks > 1 else stage_objs[0], n_microbatches=m, loss_fn=_loss)
    x, y = torch.randn(MB * m, DIM), torch.randn(MB * m, DIM)
    walls = []
    for _b in range(WARMUP + BATCHES):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        elif rank == stages - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        walls.append(time.perf_counter() - t0)
    return walls[WARMUP:]


def _idle(traces_by_rank):
    """Median over batches of the mean idle fraction over stages."""
    per_batch = []
    for b in range(len(traces_by_rank[0])):
        ev = [traces_by_rank[r][b] for r in range(len(traces_by_rank))]
        t0 = min(e[2] for tr in ev for e in tr)
        t1 = max(e[3] for tr in ev for e in tr)
        idle = [1 - sum(e[3] - e[2] for e in tr) / (t1 - t0) for tr in ev]
        per_batch.append(sum(idle) / len(idle))
    return statistics.median(per_batch), min(per_batch), max(per_batch)


def main() -> None:
    from zero_core.testing import run_multirank

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_pipe.md"))
    args = ap.parse_args()
    rows = []
    for stages in (2, 4):
        for m in (4, 8):
            for chunks in (1, 2):
                res = run_multirank(_zero_pipe_rank, stages, args=(stages, m, chunks), timeout=300)
                med, lo, hi = _idle([r[0] for r in res])
                wall = statistics.median(max(r[1][b] for r in res) for b in range(BATCHES))
                theory = (stages - 1) / (chunks * m + stages - 1)
                name = "zero_pipe 1F1B" if chunks == 1 else "zero_pipe interleaved (2 chunks)"
                rows.append(
                    (
                        stages,
                        m,
                        name,
                        f"{med:.3f} [{lo:.3f}, {hi:.3f}]",
                        f"{theory:.3f}",
                        f"{(med - theory) * 100:+.1f}",
                        wall,
                        MB * m / wall,
                    )
                )
                print(rows[-1], flush=True)
            for sname in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"):
                try:
                    res = run_multirank(_torch_rank, stages, args=(stages, m, sname), timeout=300)
                    wall = statistics.median(max(r[b] for r in res) for b in range(BATCHES))
                    rows.append(
                        (
                            stages,
                            m,
                            f"torch.distributed.pipelining {sname}",
                            "n/a",
                            "",
                            "",
                            wall,
                            MB * m / wall,
                        )
                    )
                except Exception as err:  # record, do not hide, what does not run on gloo CPU
                    rows.append(
                        (
                            stages,
                            m,
                            f"torch.distributed.pipelining {sname}",
                            f"failed: {str(err)[:80]}",
                            "",
                            "",
                            float("nan"),
                            float("nan"),
                        )
                    )
                print(rows[-1], flush=True)
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        commit = "uncommitted"
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    lines = [
        "# bench_pipe: pipeline bubble and throughput",
        "",
        f"- machine: nproc={os.cpu_count()}, CPU: {cpu}, {platform.platform()}",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- git commit: {commit}",
        "- command: `OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_pipe.py`",
        f"- model: {BLOCKS_PER_STAGE} x Linear({DIM},{DIM})+tanh per stage, micro batch {MB}, fp32, gloo, "
        f"{BATCHES} measured batches after {WARMUP} warm-up; medians, [min, max] over batches",
        "- idle = mean over stages of 1 - busy(F+B compute) / batch span; theory (p-1)/(c*m+p-1) "
        "(c = chunks per stage); diff = measured - theory in points",
        "",
        "| stages p | micro-batches m | schedule | idle measured | idle theory | diff (pts) | s/batch | samples/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {r[6]:.4f} | {r[7]:.0f} |")
    with open(args.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
