"""ZeRO stage 3 step time and per-rank memory against torch FSDP2, DDP and DeepSpeed stage 3 (2 ranks, gloo, CPU).

Same GPT (examples/gpt.py), micro-batch and Adam for every variant. One launch of 2 forked ranks
per precision (fp32, bf16) builds every variant (FSDP2 ``fully_shard`` per block then the root,
zero stage 3, with ``--deepspeed-path DIR`` DeepSpeed stage 3 with the same zero_optimization
settings, with ``--ddp`` torch DDP); the variants take turns, a few steps each, over ``--passes`` passes
(see [Note: interleaved step-time ratios] in _timing.py). Each pass gives a ratio variant/FSDP2
for wall time and for the ranks' process CPU time; the tables give their median and interquartile
range, the load average, a per-phase breakdown (forward, backward, optimizer step: wall and
main-thread CPU; collectives' time on gloo's thread from one profiled step) and model-state bytes
(``engine.memory_breakdown()``) against the ZeRO formula 16Ψ/N ((4+4+8)Ψ/N fp32, (2+2+12)Ψ/N bf16).

``--check``: re-run and say whether the README's quoted ratios (its "Step time" table) lie inside
the new interquartile ranges (exit status 1 if not). DeepSpeed: ``pip install --no-deps --target
DIR deepspeed==0.19.8 hjson py-cpuinfo ninja msgpack`` on this env's torch.

Run: OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_zero3.py [--passes 5] [--steps 1]
     [--deepspeed-path /tmp/ds] [--ddp] [--check]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import resource
import sys
import time
from pathlib import Path

import _timing
import torch
from bench_env import cpu_model, fork_ranks, git_commit
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


def _build(name: str, precision: str) -> dict:
    """One variant in this rank: ``step(clock, s)`` (phases timed) and ``states()`` (model-state bytes)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = _model()
    psi = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    low = torch.bfloat16 if precision == "bf16" else torch.float32
    states = {"bytes": 0}
    if name in ("zero3", "deepspeed3"):
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 10**9,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}},
            "zero_optimization": ZERO,
        }
        if precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        if name == "zero3":
            import zero_core

            engine = zero_core.initialize(model=model, config=cfg)[0]

            def measure() -> int:
                m = engine.memory_breakdown()
                return m["parameters"] + m["gradients"] + m["master_weights"] + m["optimizer_states"]
        else:
            import deepspeed

            engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]

            def measure() -> int:
                return _deepspeed_state_bytes(engine.optimizer)

        def fwd(x, y):
            return engine(x, y)

        def bwd(loss) -> None:
            engine.backward(loss)

        def opt_step() -> None:
            engine.step()
    else:
        if name == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp_policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)
            for blk in model.blocks:
                fully_shard(blk, mp_policy=mp_policy)
            fully_shard(model, mp_policy=mp_policy)
            run = model
        elif name == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            if precision == "bf16":
                model.to(torch.bfloat16)
            run = DDP(model)
        else:
            raise ValueError(f"unknown variant {name!r}: ddp, fsdp2, zero3 or deepspeed3")
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        measure = None

        def fwd(x, y):
            return run(x, y)

        def bwd(loss) -> None:
            loss.backward()

        def opt_step() -> None:
            opt.step()
            opt.zero_grad()

    def step(clock, s: int) -> None:
        x, y = _batch(s, rank)
        with clock.phase("forward"):
            loss = fwd(x, y)
        with clock.phase("backward"):
            bwd(loss)
        if measure is not None and s >= 10_000:  # the profiled last step, outside the timed steps
            states["bytes"] = max(states["bytes"], measure())
        with clock.phase("step"):
            opt_step()

    return {"step": step, "states": lambda: states["bytes"], "psi": psi}


def _timed_rank(names: list[str], precision: str, passes: int, steps: int) -> dict:
    """Every variant built in these ranks, then run in turn (see [Note: interleaved step-time ratios])."""
    import torch.distributed as dist

    built = {name: _build(name, precision) for name in names}
    records = _timing.interleave({n: v["step"] for n, v in built.items()}, passes, steps, dist.barrier)
    comm_s = {}
    for name, v in built.items():  # one profiled step each: the collectives' time on gloo's thread
        dist.barrier()
        clock = _timing.PhaseClock()
        comm_s[name] = _timing.collective_seconds(
            lambda v=v, c=clock: c.run(lambda cc: v["step"](cc, 10_000))
        )
    return {
        "records": records,
        "comm": comm_s,
        "syncs": _host_syncs(built),
        "states": {n: v["states"]() for n, v in built.items()},
        "psi": built[names[0]]["psi"],
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _host_syncs(built: dict) -> dict[str, int]:
    """Host syncs per step of each variant, counted on untimed steps (see host_syncs_column.py)."""
    clock = _timing.PhaseClock()
    return {
        n: host_syncs_per_step(lambda s, v=v: clock.run(lambda cc: v["step"](cc, s)), 5_000)
        for n, v in built.items()
    }


def _tables(res: dict[str, list[dict]], names: list[str]) -> tuple[list[str], dict]:
    """Ratio table, per-phase table (per precision); measured ratio quartiles keyed as the README quotes them."""
    lines = [
        "| variant | precision | wall step ms, median (IQR) | CPU step ms, median (IQR) "
        "| wall ratio vs FSDP2, median (IQR) | CPU ratio vs FSDP2, median (IQR) | model states/rank (MiB) "
        "| vs 16Ψ/N | host syncs/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    phases = [
        "| variant | precision | forward wall | forward wait | backward cpu (compute + hooks) | backward wait "
        "| step cpu | step wait | reduce (gloo) | gather (gloo) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    measured = {}
    for precision, rr in res.items():
        recs = _timing.merge_ranks([r["records"] for r in rr])
        psi = rr[0]["psi"]
        for n in names:
            wall_r = _timing.ratio_quartiles(recs[n], recs["fsdp2"], "wall")
            cpu_r = _timing.ratio_quartiles(recs[n], recs["fsdp2"], "cpu")
            if n != "fsdp2":
                measured[f"{n}/fsdp2 {precision}"] = (wall_r, cpu_r)
            st = max(r["states"][n] for r in rr)
            st_cells = f"{st / 2**20:.1f} | {st / (16 * psi / 2):.3f}" if st else "- | -"
            lines.append(
                f"| {n} | {precision} | {_timing.fmt_iqr(_timing.step_quartiles(recs[n], 'wall'), 1e3, 0)} "
                f"| {_timing.fmt_iqr(_timing.step_quartiles(recs[n], 'cpu'), 1e3, 0)} "
                f"| {_timing.fmt_iqr(wall_r)} | {_timing.fmt_iqr(cpu_r)} | {st_cells} "
                f"| {syncs_cell({'syncs': [r['syncs'][n] for r in rr if 'syncs' in r]})} |"
            )
            ph = _timing.phase_medians(recs[n])
            comm = {k: sorted(r["comm"][n][k] for r in rr)[len(rr) // 2] for k in ("reduce", "gather")}
            (fw, fc), (bw, bc), (sw, sc) = ph["forward"], ph["backward"], ph["step"]
            phases.append(
                f"| {n} | {precision} | {fw * 1e3:.0f} | {(fw - fc) * 1e3:.0f} | {bc * 1e3:.0f} | {(bw - bc) * 1e3:.0f} "
                f"| {sc * 1e3:.0f} | {(sw - sc) * 1e3:.0f} | {comm['reduce'] * 1e3:.0f} | {comm['gather'] * 1e3:.0f} |"
            )
    return [
        *lines,
        "",
        "## Where the time goes (median ms per step, both ranks)",
        "",
        _timing.PHASE_LEGEND,
        "",
        *phases,
    ], measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1, help="steps of each variant per pass")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--deepspeed-path", default=None, help="folder holding deepspeed (pip --target)")
    ap.add_argument("--check", action="store_true", help="compare the README's quoted ratios with a new run")
    ap.add_argument(
        "--ddp", action="store_true", help="also torch DDP (off by default: a long run on 2 cores)"
    )
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    precisions = a.precisions.split(",")
    if a.steps < 1 or a.passes < 5 or not set(precisions) <= {"fp32", "bf16"}:
        raise SystemExit("--steps must be >= 1, --passes >= 5, --precisions a subset of fp32,bf16")
    names = ["fsdp2", "zero3"] + (["ddp"] if a.ddp else [])
    versions = f"python {platform.python_version()}, torch {torch.__version__}"
    if a.deepspeed_path:
        sys.path.insert(0, a.deepspeed_path)  # the forked ranks inherit it
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        names.append("deepspeed3")
        versions += f", deepspeed {deepspeed.__version__} (DS_ACCELERATOR={os.environ['DS_ACCELERATOR']})"
    commit = git_commit("packages/zero-core", "tools/bench")  # the code measured: read before the run
    load = _timing.LoadLog()
    t0 = time.perf_counter()
    res = {}
    for precision in precisions:  # one launch per precision, all variants interleaved in it
        res[precision] = fork_ranks(_timed_rank, (names, precision, a.passes, a.steps), 2)
        load.sample()
    wall = time.perf_counter() - t0
    tables, measured = _tables(res, names)
    if a.check:
        lines, ok = _timing.check_lines(_timing.readme_quotes(ROOT / "README.md", "bench_zero3"), measured)
        print("\n".join(lines + [f"load: {load.describe()}", "check: " + ("ok" if ok else "FAILED")]))
        sys.exit(0 if ok else 1)
    psi = next(iter(res.values()))[0]["psi"]
    flag = f" --deepspeed-path {a.deepspeed_path}" if a.deepspeed_path else ""
    lines = [
        "# bench_zero3: ZeRO stage 3 vs torch DDP, FSDP2"
        + (" and DeepSpeed stage 3" if flag else "")
        + " (CPU, gloo, 2 ranks)",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}",
        f"- load: {load.describe()}",
        f"- versions: {versions}",
        f"- git commit: {commit}",
        f"- command: `OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_zero3.py --passes {a.passes} "
        f"--steps {a.steps}{flag}{' --ddp' if a.ddp else ''}`",
        f"- model: examples/gpt.py GPT d_model 512, 6 layers, 8 heads, seq 128, Ψ = {psi:,}; micro-batch {MICRO} "
        f"per rank; Adam lr 1e-4, no clipping; zero_optimization {ZERO} (same for zero3 and deepspeed3)",
        "- FSDP2: fully_shard per block then root, MixedPrecisionPolicy(param_dtype, reduce_dtype) = the precision;"
        " DDP bf16 = model cast to bf16; zero3 with its collective agreement checks on (the default)",
        f"- one launch of 2 forked ranks per precision, every variant built in it; {a.passes} passes, each running "
        f"every variant for {a.steps} steps in turn (after 1 warm-up step each); a ratio per pass (median step "
        "over both ranks / FSDP2's in that pass); median and interquartile range of those ratios. "
        "CPU = process CPU time of a rank (all its threads)",
        "- model states: live shard bytes after backward (engine.memory_breakdown()); for deepspeed3 its "
        "optimizer's live flat buffers (each storage once); theory 16Ψ/N bytes (fp32: 4+4+8, bf16: 2+2+12)",
        f"- benchmark wall time: {wall:.0f} s",
        "",
        *tables,
        "",
    ]
    text = "\n".join(lines)
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
