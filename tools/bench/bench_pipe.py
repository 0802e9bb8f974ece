"""Pipeline bubble and throughput: zero_pipe 1F1B / interleaved vs theory and torch.distributed.pipelining.

One launch per pipeline depth p runs every schedule on the same model (``--layers`` blocks split
evenly over the p stages, or over 2p chunks for interleaving), interleaving the repetitions of all
schedules so that load from other jobs on the machine hits them alike. zero_pipe runs textbook 1F1B,
1F1B with ``pipeline.lookahead = 1`` (see [Note: 1F1B lookahead] in ``zero_pipe/schedule.py``) and
the interleaved schedule. Each rank is pinned to one core (see ``_core_of``): with p=2 every stage
owns a core, with p=4 two stages share one (oversubscribed: wall-clock idle there is not a pipeline
bubble, a stage that waits hands its core to its neighbour).

Per batch and stage: busy = wall time inside forward/backward compute (perf_counter around the
compute of each instruction; for torch.distributed.pipelining, around its stage's
``forward_maybe_with_nosync``/``backward_maybe_with_nosync``), span = first compute start to last
compute end over all stages, idle = 1 - busy / span, averaged over stages. Thread CPU time over the
same compute spans gives the share of compute wall time stolen by other processes (steal), and the
idle by CPU time (a stage is busy only while it runs on a core), whose floor with p ranks on n < p
cores is 1 - n/p: the time-sharing table says what the machine allows.

Two models. The default, GPT-style transformer layers (d=256, sequence 128, micro batch 8), has the
compute per activation byte of the models pipelines are used for: 4 layers compute ~6.7 kFLOP per
byte they send; a GPT-2-sized stage more (6 d FLOPs per message byte per layer: 4.6 k at d=768). The
other, ``--block linear`` (Linear(1024,1024) + tanh, micro batch 128), computes ~2 kFLOP per byte
and is kept as a stress case: on this machine gloo's loopback TCP costs a stage ~0.4 ms of CPU per
512 KiB message, a visible share of its ~9 ms forward, on top of the model's own imbalance (the
first stage never computes an input gradient).

Three references for the idle fraction:
- formula: (p-1)/(c*m+p-1) (equal-cost slots, c chunks per stage);
- cost-aware: the schedule simulated (asynchronous sends, no transport cost) with each stage's
  median measured forward and backward times of this configuration;
- replay: the schedule simulated with the exact measured duration of every computation of the
  batch: the idle the dependencies alone imply; measured minus replay is transport/runtime overhead.

    OMP_NUM_THREADS=1 python tools/bench/bench_pipe.py [--out tools/bench/results/bench_pipe.md]
    OMP_NUM_THREADS=1 python tools/bench/bench_pipe.py --block linear \
        --out tools/bench/results/bench_pipe_linear.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from bench_env import cpu_model, git_commit
from torch import nn
from zero_pipe.schedule import InterleavedTrainSchedule, TrainSchedule
from zero_pipe.timeline import Compute


class Block(nn.Module):
    """Linear + tanh: 2 d^2 FLOPs per sample per forward against a d-float message, communication-heavy."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class TransformerBlock(nn.TransformerEncoderLayer):
    """A pre-norm GPT-style layer (attention + 4d GELU MLP, no dropout): the compute per activation byte of
    the models pipelines are used for."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__(
            dim,
            heads,
            dim_feedforward=4 * dim,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )


def _block_spec(block: str, dim: int, heads: int) -> tuple[type[nn.Module], tuple]:
    """The block class and its constructor arguments for ``--block``."""
    return (TransformerBlock, (dim, heads)) if block == "transformer" else (Block, (dim,))


def _loss(out, y):
    return ((out - y) ** 2).mean()


class GPipeOrder(TrainSchedule):
    """All forwards, then all backwards (GPipe), compiled by zero_pipe's planner for simulation."""

    def _compute_order(self, stage):
        m = self.micro_batches
        return [Compute("F", 0, i) for i in range(m)] + [Compute("B", 0, i) for i in range(m)]


#: torch.distributed.pipelining schedules benchmarked -> the zero_pipe schedule (class, kwargs)
#: with the same compute order, which the analysis simulates
TORCH_SCHEDULES = {
    "ScheduleGPipe": (GPipeOrder, {}),
    "Schedule1F1B": (TrainSchedule, {}),
    "ScheduleInterleaved1F1B": (InterleavedTrainSchedule, {"chunks": 2}),
}


# -- ranks ---------------------------------------------------------------------------------
def _core_of(rank: int, p: int, cores: list[int]) -> int:
    """The core rank ``rank`` of ``p`` runs on: its own while p <= cores; otherwise stage s shares
    with stage p-1-s, whose busy periods complement its own (the first stages compute most in the
    warm-up, the last ones in the drain). Time-shared replays of 1F1B (F=1, B=2, p=4 on 2 cores)
    give spans of 28 (m=4) and 52 (m=8) units with this pairing against 32 and 56 with r % 2."""
    if p <= len(cores):
        return cores[rank]
    return cores[min(rank, p - 1 - rank) % len(cores)]


def _spanned(fn, kind, chunk, sink):
    def wrapper(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        sink.append((kind, chunk, start, time.perf_counter(), time.thread_time() - cpu))
        return out

    return wrapper


def _bench_rank(p, ms, reps, warmup, model_args, mb, layers):
    from torch.distributed import pipelining as pp
    from zero_pipe import LayerSpec, PipelineEngine, PipelineModule

    block, dim, seq, heads = model_args
    block_cls, block_args = _block_spec(block, dim, heads)
    rank = torch.distributed.get_rank()
    core = _core_of(rank, p, sorted(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    torch.manual_seed(0)

    runners = []  # (name, m, run(batch_data) -> spans)
    sims = {}  # name -> (schedule class, kwargs) simulated for the row
    for chunks, lookahead in ((1, 0), (1, 1), (2, 0)):
        model = PipelineModule(
            [LayerSpec(block_cls, *block_args) for _ in range(layers)],
            num_stages=p,
            loss_fn=_loss,
            partition_method="uniform",
            num_chunks=chunks,
        )
        engine = PipelineEngine(
            model,
            torch.optim.SGD(model.parameters(), lr=1e-4),
            {
                "train_micro_batch_size_per_gpu": mb,
                "gradient_accumulation_steps": ms[0],
                "pipeline": {"lookahead": lookahead},
            },
        )
        name = "zero_pipe interleaved (2 chunks)" if chunks > 1 else "zero_pipe 1F1B"
        name += f" (lookahead {lookahead})" if lookahead else ""
        if chunks > 1:
            sims[name] = (InterleavedTrainSchedule, {"chunks": chunks})
        else:
            sims[name] = (TrainSchedule, {"lookahead": lookahead})
        for m in ms:

            def run(data, engine=engine, m=m):
                engine.set_train_batch_size(mb * m)
                engine.trace = []
                engine.train_batch(iter(data))
                return [tuple(s) for s in engine.trace]

            runners.append((name, m, run))
    for sname, sim in TORCH_SCHEDULES.items():
        chunks = sim[1].get("chunks", 1)
        sims[f"torch.distributed.pipelining {sname}"] = sim
        per = layers // (p * chunks)
        for m in ms:
            sink: list = []
            stages, params = [], []
            for c in range(chunks):
                mod = nn.Sequential(*[block_cls(*block_args) for _ in range(per)])
                params += list(mod.parameters())
                st = pp.PipelineStage(mod, c * p + rank, p * chunks, torch.device("cpu"))
                st.forward_maybe_with_nosync = _spanned(st.forward_maybe_with_nosync, "F", c, sink)
                st.backward_maybe_with_nosync = _spanned(st.backward_maybe_with_nosync, "B", c, sink)
                stages.append(st)
            sched = getattr(pp, sname)(stages if chunks > 1 else stages[0], n_microbatches=m, loss_fn=_loss)
            # The same optimizer step as zero_pipe's batch, so that s/batch compares like with like.
            opt = torch.optim.SGD(params, lr=1e-4)

            def run(data, sched=sched, sink=sink, opt=opt):
                sink.clear()
                x = torch.cat([d[0] for d in data])
                y = torch.cat([d[1] for d in data])
                if rank == 0:
                    sched.step(x)
                elif rank == p - 1:
                    sched.step(target=y, losses=[])
                else:
                    sched.step()
                opt.step()
                opt.zero_grad()
                return list(sink)

            runners.append((f"torch.distributed.pipelining {sname}", m, run))

    shape = (mb, seq, dim) if block == "transformer" else (mb, dim)
    datas = {m: [(torch.randn(shape), torch.randn(shape)) for _ in range(m)] for m in ms}
    results = {(name, m): [] for name, m, _ in runners}
    loads = []
    for rep in range(warmup + reps):
        for name, m, run in runners:
            torch.distributed.barrier()
            if rank == 0:
                loads.append(os.getloadavg()[0])
            t0, c0 = time.perf_counter(), time.process_time()
            spans = run(datas[m])
            t1, c1 = time.perf_counter(), time.process_time()
            if rep >= warmup:
                results[(name, m)].append({"t0": t0, "t1": t1, "cpu": c1 - c0, "spans": spans})
    return results, loads, core, sims


# -- analysis ------------------------------------------------------------------------------
def _analyse(cls, kw, m, p, batches, ncores, pinning):
    """The measures of one row, whose schedule ``cls(m, p, stage, **kw)`` is what is simulated."""
    from zero_pipe.simulator import simulate
    from zero_pipe.timeshare import replay_timeshared

    timeline = cls(m, p, 0, **kw).timeline
    chunks = kw.get("chunks", 1)
    kinds = [[(c.kind, c.chunk) for c in order] for order in timeline.orders]
    idles, replays, walls, steal_num, steal_den, waits = [], [], [], 0.0, 0.0, []
    cpu_idles, cpu_replays, core_use, others, shared = [], [], [], [], []
    f_times = [[] for _ in range(p)]
    b_times = [[] for _ in range(p)]
    replay_ok = True
    for b in batches:  # b: per-rank dicts of one batch
        compute = [[s for s in r["spans"] if s[0] in "FB"] for r in b]
        t0 = min(s[2] for c in compute for s in c)
        t1 = max(s[3] for c in compute for s in c)
        busy = [sum(s[3] - s[2] for s in c) for c in compute]
        idles.append(statistics.fmean(1 - x / (t1 - t0) for x in busy))
        cpu_idles.append(statistics.fmean(1 - sum(s[4] for s in c) / (t1 - t0) for c in compute))
        wall = max(r["t1"] for r in b) - min(r["t0"] for r in b)
        walls.append(wall)
        core_use.append(sum(r["cpu"] for r in b) / (min(p, ncores) * wall))
        # Receive waits, and time neither computing nor waiting, inside each stage's own window
        # (its first compute start to its last compute end: the drain after it is bubble, not overhead).
        windows = [(c[0][2], c[-1][3]) for c in compute]
        wait = [
            sum(max(0.0, min(s[3], hi) - max(s[2], lo)) for s in r["spans"] if s[0] == "W")
            for r, (lo, hi) in zip(b, windows)
        ]
        waits.append(statistics.fmean(wait) / (t1 - t0))
        others.append(
            statistics.fmean((hi - lo - x - w) / (t1 - t0) for (lo, hi), x, w in zip(windows, busy, wait))
        )
        for st, c in enumerate(compute):
            for s in c:
                (f_times if s[0] == "F" else b_times)[st].append(s[3] - s[2])
                steal_num += (s[3] - s[2]) - s[4]
                steal_den += s[3] - s[2]
        if [[(s[0], s[1]) for s in c] for c in compute] == kinds:
            wall_costs = [[s[3] - s[2] for s in c] for c in compute]
            cpu_costs = [[s[4] for s in c] for c in compute]
            replays.append(simulate(cls, m, p, eager_sends=True, op_costs=wall_costs, **kw).bubble_fraction)
            cpu_replays.append(
                simulate(cls, m, p, eager_sends=True, op_costs=cpu_costs, **kw).bubble_fraction
            )
            shared.append(replay_timeshared(timeline, cpu_costs, pinning).idle_wall)
        else:
            replay_ok = False
    # Cost-aware: per-stage median forward/backward time (chunks of a stage are equal in size).
    med_f = [statistics.median(x) for x in f_times]
    med_b = [statistics.median(x) for x in b_times]
    costs = [[med_f[s] if k == "F" else med_b[s] for k, _ in kinds[s]] for s in range(p)]
    cost_aware = simulate(cls, m, p, eager_sends=True, op_costs=costs, **kw).bubble_fraction
    return {
        "idle": idles,
        "formula": (p - 1) / (chunks * m + p - 1),
        "cost_aware": cost_aware,
        "replay": replays if replay_ok else None,
        "cpu_replay": cpu_replays if replay_ok else None,
        "shared": shared if replay_ok else None,
        "wall": walls,
        "steal": steal_num / steal_den,
        "wait": statistics.median(waits),
        "other": statistics.median(others),
        "cpu_idle": cpu_idles,
        "floor": 1 - min(p, ncores) / p,
        "core_use": core_use,
        "f_ms": [1e3 * x for x in med_f],
        "b_ms": [1e3 * x for x in med_b],
        "messages": 2 * m * (chunks * p - 1),
    }


def _fmt_spread(xs, scale=1.0, digits=3):
    return f"{statistics.median(xs) * scale:.{digits}f} [{min(xs) * scale:.{digits}f}, {max(xs) * scale:.{digits}f}]"


def main() -> None:
    from zero_core.testing import run_multirank

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_pipe.md"))
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--reps", type=int, default=10, help="measured batches per row (shared machine: medians)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--block",
        choices=["transformer", "linear"],
        default="transformer",
        help="transformer: GPT-style layers (default); linear: Linear+tanh, a communication-heavy stress case",
    )
    ap.add_argument(
        "--dim", type=int, default=None, help="model width (default 256 transformer, 1024 linear)"
    )
    ap.add_argument("--seq", type=int, default=128, help="sequence length (--block transformer)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (--block transformer)")
    ap.add_argument(
        "--mb", type=int, default=None, help="micro-batch size (default 8 transformer, 128 linear)"
    )
    ap.add_argument("--layers", type=int, default=8, help="blocks of the whole model")
    args = ap.parse_args()
    transformer = args.block == "transformer"
    args.dim = args.dim or (256 if transformer else 1024)
    args.mb = args.mb or (8 if transformer else 128)
    if transformer and args.dim % args.heads:
        raise SystemExit(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    for p in args.stages:
        if args.layers % (2 * p):
            raise SystemExit(f"--layers must be a multiple of 2 * stages ({2 * p}) for interleaving")
    ncores = len(os.sched_getaffinity(0))
    started = time.perf_counter()
    load_before = os.getloadavg()
    rows, loads = [], []
    for p in args.stages:
        res = run_multirank(
            _bench_rank,
            p,
            args=(
                p,
                args.micro_batches,
                args.reps,
                args.warmup,
                (args.block, args.dim, args.seq, args.heads),
                args.mb,
                args.layers,
            ),
            timeout=600,
        )
        loads.extend(res[0][1])
        pinning = [r[2] for r in res]
        sims = res[0][3]
        for name, m in res[0][0]:
            batches = list(zip(*[r[0][(name, m)] for r in res]))
            a = _analyse(*sims[name], m, p, batches, ncores, pinning)
            rows.append((p, m, name, a, pinning))
            lists = ("idle", "wall", "replay", "cpu_replay", "shared", "cpu_idle", "core_use")
            print(p, m, name, {k: v for k, v in a.items() if k not in lists}, flush=True)
    elapsed = time.perf_counter() - started
    _write(args, rows, loads, load_before, os.getloadavg(), elapsed)


def _model_text(args) -> str:
    if args.block == "transformer":
        return (
            f"{args.layers} x pre-norm transformer layer (d={args.dim}, {args.heads} heads, MLP {4 * args.dim}, "
            f"GELU, no dropout; sequence {args.seq})"
        )
    return f"{args.layers} x (Linear({args.dim},{args.dim}) + tanh)"


def _message_kib(args) -> float:
    """Bytes of one activation (or gradient) message between stages, in KiB."""
    return args.mb * (args.seq if args.block == "transformer" else 1) * args.dim * 4 / 1024


def _write(args, rows, loads, load_before, load_after, elapsed):
    commit = git_commit("packages/zero-pipe", "tools/bench/bench_pipe.py")
    cpu = cpu_model()
    argv = " ".join(sys.argv[1:])
    pins = ", ".join(f"{pin} (p={p})" for p, pin in {r[0]: r[4] for r in rows}.items())
    cmd = f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} .venv/bin/python tools/bench/bench_pipe.py"
    cmd += f" {argv}" if argv else ""
    lines = [
        "# bench_pipe: pipeline bubble and throughput",
        "",
        f"- machine: nproc={os.cpu_count()}, CPU: {cpu}, {platform.platform()}",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- git commit: {commit}",
        f"- command: `{cmd}` (run time {elapsed:.0f} s)",
        f"- load average (1 min) before {load_before[0]:.1f}, after {load_after[0]:.1f}; sampled before every "
        f"batch: median {statistics.median(loads):.1f} [{min(loads):.1f}, {max(loads):.1f}] on {os.cpu_count()} cores",
        f"- model: {_model_text(args)} split over the stages (or 2 chunks per "
        f"stage), micro batch {args.mb}, message {_message_kib(args):.0f} KiB, fp32, gloo, one thread per rank, ranks 0..p-1 pinned to "
        f"cores {pins}; "
        f"{args.reps} measured batches per row after {args.warmup} warm-up, repetitions interleaved across rows; "
        "medians [min, max] over batches",
        "- s/batch = first rank's start to last rank's end of one batch, SGD step included for both libraries "
        "(zero_pipe's batch also all-reduces the global gradient norm over the stages and broadcasts the loss, "
        "as DeepSpeed's does); samples/s = micro batch x m / median s/batch",
        "- idle = mean over stages of 1 - busy / span (busy: wall time inside forward/backward compute; span: first "
        "compute start to last compute end over all stages). formula = (p-1)/(c m + p-1); cost-aware = simulated "
        "schedule with the per-stage median F/B times; replay = simulated schedule with every measured F/B duration "
        "of the batch (n/a: the library's compute order differs from the simulated one); steal = share of compute "
        "wall time the thread was off-CPU; wait = mean share of the span a stage spent blocked on a receive "
        "between its own first and last computation; other = mean share of the span a stage spent in that "
        "window neither computing nor waiting (sends, Python, loading micro-batches); "
        "target = |measured - formula| <= 5 points",
        "",
        "| p | m | schedule | s/batch | samples/s | idle measured | formula | cost-aware | replay | measured - "
        "formula (pts) | target | measured - replay (pts) | steal | wait | other |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ours = ("zero_pipe",)
    for p, m, name, a, _pin in rows:
        wall = statistics.median(a["wall"])
        idle = statistics.median(a["idle"])
        replay = a["replay"]
        gap = (idle - a["formula"]) * 100
        lines.append(
            f"| {p} | {m} | {name} | {_fmt_spread(a['wall'])} | {args.mb * m / wall:.0f} | {_fmt_spread(a['idle'])} | "
            f"{a['formula']:.3f} | {a['cost_aware']:.3f} | "
            + (f"{statistics.median(replay):.3f}" if replay else "n/a")
            + f" | {gap:+.1f} | {'met' if abs(gap) <= 5 else 'not met'} | "
            + (f"{(idle - statistics.median(replay)) * 100:+.1f}" if replay else "n/a")
            + f" | {a['steal'] * 100:.0f}% | "
            + (f"{a['wait'] * 100:.0f}% | {a['other'] * 100:.1f}%" if name.startswith(ours) else "n/a | n/a")
            + " |"
        )
    lines += [
        "",
        "Time-sharing view (what the cores allow). idle by CPU time = mean over stages of 1 - (thread CPU time inside "
        "forward/backward) / span: a stage counts as busy only while it runs on a core. With p ranks on "
        "n = min(p, cores) cores at most n stages compute at once, so this idle cannot go below the floor "
        "1 - n/p (0 for p <= cores). replay (CPU costs) = the schedule simulated with every computation's CPU "
        "time: the idle p dedicated cores would give for the same compute. time-shared replay = the same "
        "computations replayed on this run's cores (the pinning above), each core split among the stages "
        "computing on it (zero_pipe.timeshare, [Note: time-shared replay]), idle measured by wall time like the "
        "measurement: what this machine allows with no runtime overhead. core use = CPU time of all rank processes "
        "(every thread, gloo's included) / (n x wall time of the batch).",
        "",
        "| p | m | schedule | idle measured (wall) | time-shared replay (wall) | measured - time-shared (pts) | "
        "idle by CPU time | floor 1 - n/p | replay (CPU costs) | core use |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, m, name, a, _pin in rows:
        cpu_replay, ts = a["cpu_replay"], a["shared"]
        idle = statistics.median(a["idle"])
        lines.append(
            f"| {p} | {m} | {name} | {idle:.3f} | "
            + (
                f"{statistics.median(ts):.3f} | {(idle - statistics.median(ts)) * 100:+.1f}"
                if ts
                else "n/a | n/a"
            )
            + f" | {_fmt_spread(a['cpu_idle'])} | {a['floor']:.3f} | "
            + (f"{statistics.median(cpu_replay):.3f}" if cpu_replay else "n/a")
            + f" | {statistics.median(a['core_use']) * 100:.0f}% |"
        )
    lines += [
        "",
        "Per-stage median compute time of one micro-batch (ms; interleaved: one chunk) and messages per batch:",
        "",
        "| p | m | schedule | forward ms per stage | backward ms per stage | B/F | messages |",
        "|---|---|---|---|---|---|---|",
    ]
    for p, m, name, a, _pin in rows:
        bf = statistics.fmean(b / f for b, f in zip(a["b_ms"], a["f_ms"]))
        lines.append(
            f"| {p} | {m} | {name} | {', '.join(f'{x:.1f}' for x in a['f_ms'])} | "
            f"{', '.join(f'{x:.1f}' for x in a['b_ms'])} | {bf:.2f} | {a['messages']} |"
        )
    with open(args.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
