"""ZeRO stage 3 step time and per-rank memory against torch FSDP2 and DeepSpeed stage 3 (2 ranks, gloo, CPU).

Same GPT (examples/gpt.py), micro-batch and Adam for every variant; each variant runs in its own
pair of forked ranks (so peak RSS is per variant), variants alternate within a pass and the
passes repeat (the machine is shared and noisy: compare ratios from one launch only).

* default launch (project venv): torch DDP, FSDP2 (``fully_shard`` per block, then the root) and
  zero stage 3 (agreement checks on, the default, and off), fp32 and bf16.
* ``--deepspeed`` (run with a venv that has deepspeed and zero-core, e.g. /tmp/dsvenv after
  ``pip install --no-deps -e packages/zero-core``): DDP, FSDP2, zero stage 3 and DeepSpeed stage 3
  with the same zero_optimization settings, all interleaved in one launch so every ratio is taken
  within one run.

Step time = forward + backward + optimizer step, median over timed steps (after 1 warm-up) of
every rank and pass. Model states per rank come from live tensors after backward
(``engine.memory_breakdown()``: parameter, gradient, master and optimizer-state shards), against
the ZeRO formula (4+4+8)Ψ/N for fp32 Adam and (2+2+12)Ψ/N for bf16 Adam.

Run: OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_zero3.py [--steps 3] [--passes 2]
     OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tools/bench/bench_zero3.py --deepspeed
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import platform
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_env import cpu_model, git_commit
from host_syncs_column import host_syncs_per_step, syncs_cell

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_gpt", ROOT / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
sys.modules["bench_gpt"] = gpt
_spec.loader.exec_module(gpt)

MICRO = 4
ZERO = {
    "stage": 3,
    "reduce_bucket_size": 5_000_000,
    "prefetch_bucket_size": 5_000_000,
    "param_persistence_threshold": 100_000,
    "overlap_comm": True,
}
OUT = ROOT / "tools" / "bench" / "results" / "bench_zero3.md"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(d_model=512, n_layers=6, n_heads=8, seq_len=128))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randint(0, 256, (MICRO, 129), generator=g)
    return x[:, :-1], x[:, 1:]


def _deepspeed_state_bytes(opt: object) -> int:
    """Live model-state bytes of a DeepSpeed stage-3 optimizer, each storage counted once.

    Parameter shards (``fp16_partitioned_groups_flat``: views of one flat buffer), fp32 master
    shards (DeepSpeed aliases them to the parameter shards when both are fp32), the flat gradient
    partition buffer and the optimizer states; the attribute names are those of deepspeed 0.19.8.
    """
    tensors = [
        *opt.fp16_partitioned_groups_flat,
        *opt.fp32_partitioned_groups_flat,
        opt.grad_partitions_flat_buffer,
    ]
    for st in opt.optimizer.state.values():
        tensors += [v for v in st.values() if torch.is_tensor(v)]
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel() > 0:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _variant(name: str, precision: str, steps: int) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = _model()
    psi = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    low = torch.bfloat16 if precision == "bf16" else torch.float32
    states = {"bytes": 0}
    if name in ("zero3", "zero3_nocheck"):
        import zero_core
        from zero_core.zero.stage3 import set_collective_checks

        set_collective_checks(name == "zero3")
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 10**9,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}},
            "zero_optimization": ZERO,
        }
        if precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine = zero_core.initialize(model=model, config=cfg)[0]

        def step_fn(s: int) -> None:
            x, y = _batch(s, rank)
            engine.backward(engine(x, y))
            m = engine.memory_breakdown()
            states["bytes"] = max(
                states["bytes"],
                m["parameters"] + m["gradients"] + m["master_weights"] + m["optimizer_states"],
            )
            engine.step()
    elif name == "deepspeed3":
        import deepspeed

        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 10**9,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}},
            "zero_optimization": ZERO,
        }
        if precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]

        def step_fn(s: int) -> None:
            x, y = _batch(s, rank)
            engine.backward(engine(x, y))
            states["bytes"] = max(states["bytes"], _deepspeed_state_bytes(engine.optimizer))
            engine.step()
    elif name == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp_policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)
        for blk in model.blocks:
            fully_shard(blk, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step_fn(s: int) -> None:
            x, y = _batch(s, rank)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    elif name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        if precision == "bf16":
            model.to(torch.bfloat16)
        ddp = DDP(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step_fn(s: int) -> None:
            x, y = _batch(s, rank)
            ddp(x, y).backward()
            opt.step()
            opt.zero_grad()
    else:
        raise ValueError(name)
    times = []
    for s in range(steps + 1):
        dist.barrier()
        t = time.perf_counter()
        step_fn(s)
        if s >= 1:
            times.append(time.perf_counter() - t)
    return {
        "syncs": host_syncs_per_step(step_fn, steps + 1),
        "times": times,
        "states": states["bytes"],
        "psi": psi,
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _child(fn_args: tuple, rank: int, world: int, port: int, q: mp.Queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        q.put((rank, _variant(*fn_args)))
    except BaseException as exc:  # report, do not hang the parent
        q.put((rank, repr(exc)))
        raise
    finally:
        dist.destroy_process_group()


def _launch(args: tuple, world: int = 2) -> list[dict]:
    """Fork ``world`` ranks running ``_variant(*args)`` (no zero_core needed: works in the DeepSpeed venv)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(args, r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    for _ in procs:
        rank, res = q.get(timeout=900)
        if not isinstance(res, dict):
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} of {args} failed: {res}")
        out[rank] = res
    for p in procs:
        p.join()
    return [out[r] for r in range(world)]


def _run(names: list[str], steps: int, passes: int) -> tuple[dict, list[float]]:
    """Every (variant, precision) once per pass, interleaved; also the 1-min load average before each launch."""
    rows: dict = {}
    loads: list[float] = []
    for _ in range(passes):
        for precision in ("fp32", "bf16"):
            for name in names:
                loads.append(os.getloadavg()[0])
                res = _launch((name, precision, steps))
                med = statistics.median(t for rr in res for t in rr["times"])
                print(f"{name} {precision}: median step {med * 1e3:.0f} ms", file=sys.stderr, flush=True)
                r = rows.setdefault(
                    (name, precision), {"times": [], "states": 0, "rss": 0, "psi": res[0]["psi"]}
                )
                for rr in res:
                    r["times"] += rr["times"]
                    r["states"] = max(r["states"], rr["states"])
                    r["rss"] = max(r["rss"], rr["rss"])
                    r.setdefault("syncs", []).append(rr["syncs"])
    loads.append(os.getloadavg()[0])
    return rows, loads


def _table(rows: dict) -> list[str]:
    lines = [
        "| variant | precision | median step (ms) | min-max (ms) | ratio vs fsdp2 | ratio vs ddp "
        "| peak RSS/rank (MiB) | model states/rank (MiB) | vs theory | host syncs/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, precision), r in sorted(rows.items(), key=lambda kv: kv[0][1] != "fp32"):
        t = r["times"]
        med = statistics.median(t)
        ratios = []
        for base_name in ("fsdp2", "ddp"):
            base = rows.get((base_name, precision))
            ratios.append(f"{med / statistics.median(base['times']):.2f}" if base else "-")
        theory = 16 * r["psi"] / 2
        st = f"{r['states'] / 2**20:.1f} | {r['states'] / theory:.3f}" if r["states"] else "- | -"
        lines.append(
            f"| {name} | {precision} | {med * 1e3:.0f} | {min(t) * 1e3:.0f}-{max(t) * 1e3:.0f} "
            f"| {ratios[0]} | {ratios[1]} | {r['rss'] / 2**20:.0f} | {st} | {syncs_cell(r)} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--deepspeed", action="store_true")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    if a.steps < 1 or a.passes < 1:
        raise SystemExit("--steps and --passes must be >= 1")
    names = ["ddp", "fsdp2", "zero3"] + (["deepspeed3"] if a.deepspeed else ["zero3_nocheck"])
    versions = f"python {platform.python_version()}, torch {torch.__version__}"
    if a.deepspeed:
        import deepspeed

        versions += f", deepspeed {deepspeed.__version__} (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')})"
    prefix = f"DS_ACCELERATOR=cpu {sys.executable}" if a.deepspeed else ".venv/bin/python"
    flag = " --deepspeed" if a.deepspeed else ""
    t0 = time.perf_counter()
    rows, loads = _run(names, a.steps, a.passes)
    wall = time.perf_counter() - t0
    psi = next(iter(rows.values()))["psi"]
    lines = [
        "# bench_zero3: ZeRO stage 3 vs torch DDP, FSDP2"
        + (" and DeepSpeed stage 3" if a.deepspeed else "")
        + " (CPU, gloo, 2 ranks)",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}; shared with other jobs",
        f"- load average (1 min) before each launch: min {min(loads):.1f}, median {statistics.median(loads):.1f}, "
        f"max {max(loads):.1f} ({len(loads)} samples over {wall:.0f} s)",
        f"- versions: {versions}",
        f"- git commit: {git_commit('packages/zero-core', 'tools/bench/bench_zero3.py')}",
        f"- command: `OMP_NUM_THREADS=1 {prefix} tools/bench/bench_zero3.py{flag} --steps {a.steps} "
        f"--passes {a.passes}`",
        f"- model: examples/gpt.py GPT d_model 512, 6 layers, 8 heads, seq 128, Ψ = {psi:,}; micro-batch {MICRO} "
        f"per rank; Adam lr 1e-4, no clipping; zero_optimization {ZERO} (same for zero3 and deepspeed3)",
        "- FSDP2: fully_shard per block then root, MixedPrecisionPolicy(param_dtype, reduce_dtype) = the precision;"
        " DDP bf16 = model cast to bf16",
        "- zero3 = collective agreement checks on (default)"
        + ("" if a.deepspeed else ", zero3_nocheck = off")
        + " (see [Note: stage 3 collective agreement])",
        f"- {a.passes} passes; in each pass every variant and precision runs once, in turn, in its own pair of "
        f"forked ranks; {a.steps} timed steps after 1 warm-up; times pooled over both ranks and passes",
        "- model states: max over steps of live shard bytes after backward (engine.memory_breakdown()); "
        "for deepspeed3 the same from its optimizer's live flat buffers (each storage once); "
        "theory 16Ψ/N bytes (fp32: 4+4+8, bf16: 2+2+12); '-' where no live-tensor breakdown exists",
        "- peak RSS includes the forked parent's torch import (same for all variants)",
        "- host syncs/step: device values read on the host per training step, counted on extra untimed "
        "steps (tools/bench/host_syncs_column.py), max over ranks",
        "",
        *_table(rows),
    ]
    text = "\n".join(lines) + "\n"
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
