"""Step time and per-rank memory of ZeRO stages 0, 1, 2 against torch DDP and DeepSpeed (2 ranks, gloo, CPU).

Same GPT (examples/gpt.py), same micro-batch, same Adam for every variant. All variants are built
in the same 2 forked ranks of one launch and take turns, a few steps each, over ``--passes``
passes (see [Note: interleaved step-time ratios] in _timing.py): each pass gives one ratio
variant/DDP, for wall time and for the ranks' process CPU time; the tables give the median of
those ratios with their interquartile range, the 1-min load average, a per-phase breakdown
(forward, backward, optimizer step: wall and main-thread CPU; collectives' time on gloo's thread
from one profiled step) and model-state bytes (``engine.memory_breakdown()``; for DDP parameters,
gradients and Adam states).

DeepSpeed in the same launch: ``--deepspeed-path DIR`` (a folder holding DeepSpeed 0.19.8
installed with ``pip install --no-deps --target DIR deepspeed==0.19.8 hjson py-cpuinfo ninja
msgpack``, on this env's torch) adds DeepSpeed stages 1 and 2 (fp32, client torch Adam,
``gradient_clipping: 0``, same buckets) to the turns, so their ratios are against the same DDP.

``--check``: re-run and say whether the README's quoted ratios (its "Step time" table) lie inside
the new interquartile ranges (exit status 1 if not). ``--memory-only``: model-state bytes at N = 2
and 4, deterministic.

Run: OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_zero12.py [--passes 7] [--steps 3]
     [--deepspeed-path /tmp/ds] [--check]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import resource
import sys
import time
from pathlib import Path

import _timing
import torch
from bench_env import cpu_model, git_commit
from host_syncs_column import host_syncs_per_step, syncs_cell

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_gpt", ROOT / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
sys.modules["bench_gpt"] = gpt  # dataclasses look their module up
_spec.loader.exec_module(gpt)

MICRO = 4
BUCKET = 50_000_000
STATES = ("parameters", "gradients", "master_weights", "optimizer_states")
LABELS = {"ds1": "DeepSpeed stage 1", "ds2": "DeepSpeed stage 2"}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(d_model=256, n_layers=4, n_heads=4, seq_len=128))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randint(0, 256, (MICRO, 129), generator=g)
    return x[:, :-1], x[:, 1:]


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _ddp(model: torch.nn.Module, rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, bucket_cap_mb=BUCKET * 4 / 2**20)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step(clock, s: int) -> None:
        x, y = _batch(s, rank)
        with clock.phase("forward"):
            loss = ddp(x, y)
        with clock.phase("backward"):
            loss.backward()
        with clock.phase("step"):
            opt.step()
            opt.zero_grad(set_to_none=False)  # keep gradients: they are part of DDP's model states

    def states() -> int:
        st = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        return _bytes(model.parameters()) + _bytes(p.grad for p in model.parameters()) + _bytes(st)

    return {"step": step, "states": states}


def _build(name: str, precision: str = "fp32") -> dict:
    """One variant in this rank: ``step(clock, s)`` (phases timed) and ``states()`` (model-state bytes).

    ``name``: ``ddp``, ``stage0``-``stage2`` (zero_core) or ``ds1``/``ds2`` (DeepSpeed stages 1/2, fp32,
    client torch Adam, ``gradient_clipping: 0``).
    """
    from zero_core import comm

    rank = comm.get_rank()
    model = _model()
    params = sum(p.numel() for p in model.parameters())
    if name == "ddp":
        return {**_ddp(model, rank), "params": params}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": int(name[-1]),
            "reduce_bucket_size": BUCKET,
            "allgather_bucket_size": BUCKET,
            "overlap_comm": True,
        },
    }
    if name.startswith("ds"):
        import deepspeed

        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        engine = deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]
    else:
        import zero_core

        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}}
        if precision != "fp32":
            cfg[precision] = {"enabled": True}
        engine = zero_core.initialize(model=model, config=cfg)[0]
    peak = {"states": 0, "buffers": 0}

    def step(clock, s: int) -> None:
        x, y = _batch(s, rank)
        with clock.phase("forward"):
            loss = engine(x, y)
        with clock.phase("backward"):
            engine.backward(loss)
        if s >= 10_000 and not name.startswith("ds"):  # model states after backward, in the profiled step
            m = engine.memory_breakdown()  # model states as the ZeRO paper counts them; buckets apart
            peak["states"] = max(peak["states"], sum(m[k] for k in STATES))
            peak["buffers"] = max(peak["buffers"], m.get("buffers", 0))
        with clock.phase("step"):
            engine.step()

    return {
        "step": step,
        "states": lambda: peak["states"],
        "buffers": lambda: peak["buffers"],
        "params": params,
    }


def _variant(name: str, steps: int, precision: str = "fp32", time_it: bool = False) -> dict:
    """Model-state bytes of one variant over ``steps`` + 1 steps (no timing: see ``_timed_rank``)."""
    v = _build(name, precision)
    clock = _timing.PhaseClock()
    for s in [*range(steps), 10_000]:  # the last step records the states (see _build)
        clock.run(lambda c, s=s: v["step"](c, s))
    buffers = v["buffers"]() if "buffers" in v else None  # DDP's bucket copies are torch-internal
    return {"states": v["states"](), "buffers": buffers, "params": v["params"]}


def _timed_rank(names: list[str], passes: int, steps: int, ds_path: str | None) -> dict:
    """Every variant built in these ranks, then run in turn (see [Note: interleaved step-time ratios])."""
    from zero_core import comm

    if ds_path:
        sys.path.insert(0, ds_path)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    built = {name: _build(name) for name in names}
    records = _timing.interleave({n: v["step"] for n, v in built.items()}, passes, steps, comm.barrier)
    comm_s = {}
    for name, v in built.items():  # one profiled step each: the collectives' time on gloo's thread
        comm.barrier()
        clock = _timing.PhaseClock()
        comm_s[name] = _timing.collective_seconds(
            lambda v=v, c=clock: c.run(lambda cc: v["step"](cc, 10_000))
        )
    clock = _timing.PhaseClock()  # host syncs per step, on untimed steps (see host_syncs_column.py)
    syncs = {
        n: host_syncs_per_step(lambda s, v=v: clock.run(lambda cc: v["step"](cc, s)), 5_000)
        for n, v in built.items()
    }
    return {
        "records": records,
        "comm": comm_s,
        "syncs": syncs,
        "states": {n: v["states"]() for n, v in built.items()},
        "params": built["ddp"]["params"],
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _mem_sweep() -> dict:
    """Model-state bytes of every variant and precision, one after another in these ranks."""
    out = {}
    for precision in ("bf16", "fp32"):
        for name in ("ddp", "stage0", "stage1", "stage2"):
            if name == "ddp" and precision == "bf16":
                continue
            r = _variant(name, 1, precision, False)
            out[f"{name}/{precision}"] = {"states": r["states"], "buffers": r["buffers"]}
            gc.collect()
    return out


def _memory_table(mem: dict[int, list[dict]]) -> list[str]:
    per_n = {n: {k: max(r[k]["states"] for r in res) for k in res[0]} for n, res in mem.items()}
    bufs = {n: {k: res[0][k]["buffers"] for k in res[0]} for n, res in mem.items()}
    lines = []
    for key in per_n[2]:
        name, precision = key.split("/")
        cells = []
        for n in (2, 4):
            b, base_b = per_n[n][key], per_n[n]["ddp/fp32"]
            buf = bufs[n][key]
            cells.append(
                f"{b / 2**20:.1f} | {b / base_b:.2f} | {'-' if buf is None else f'{buf / 2**20:.1f}'}"
            )
        lines.append(f"| {name} | {precision} | {' | '.join(cells)} |")
    return lines


def _memory_only(args: argparse.Namespace, run_multirank) -> None:
    mem = {n: run_multirank(_mem_sweep, n, timeout=1800) for n in (2, 4)}
    out = args.out
    if out.endswith("bench_zero12.md"):
        out = out[: -len(".md")] + "_memory.md"
    lines = [
        "# bench_zero12 --memory-only: model-state bytes per rank, ZeRO stages 0/1/2 vs torch DDP",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- git commit: {git_commit('packages/zero-core', 'tools/bench/bench_zero12.py')}",
        "- command: `OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_zero12.py --memory-only`",
        f"- model: examples/gpt.py GPT d_model 256, 4 layers, seq 128; micro-batch {MICRO}; Adam; "
        f"buckets {BUCKET:,} elements; overlap_comm on",
        "- bytes are deterministic (live storages, each counted once: [Note: memory breakdown counts "
        "storages]); the machine's load does not change them",
        "",
        "| variant | precision | N=2 (MiB) | ratio vs DDP | N=2 buffers (MiB) | N=4 (MiB) | ratio vs DDP "
        "| N=4 buffers (MiB) |",
        "|---|---|---|---|---|---|---|---|",
        *_memory_table(mem),
        "",
        "Measured after backward (peak over the step). DDP: parameters + gradients + Adam states (fp32), "
        "its own bucket copies not counted. Stage 0's gradients live in its bucket buffers and count once. "
        "'buffers': our communication buffers alive after backward (`memory_breakdown()['buffers']`, rank 0), "
        "outside the model states: stage 2 keeps one reduce bucket between steps; stage 0's buckets hold its "
        "gradients and count there. DDP's bucket copies (about 4 bytes per parameter in fp32 with "
        "gradient_as_bucket_view off) are torch-internal and not measured ('-').",
        "",
    ]
    with open(out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def _time_tables(res: list[dict], names: list[str]) -> tuple[list[str], dict]:
    """Ratio table, per-phase table; and the measured ratio quartiles keyed as the README quotes them."""
    recs = _timing.merge_ranks([r["records"] for r in res])
    base = recs["ddp"]
    states = {n: max(r["states"][n] for r in res) for n in names}
    lines = [
        "| variant | wall step ms, median (IQR) | CPU step ms, median (IQR) | wall ratio vs DDP, median (IQR) "
        "| CPU ratio vs DDP, median (IQR) | model states/rank (MiB, buckets apart) | host syncs/step |",
        "|---|---|---|---|---|---|---|",
    ]
    measured = {}
    for n in names:
        wall_r = _timing.ratio_quartiles(recs[n], base, "wall")
        cpu_r = _timing.ratio_quartiles(recs[n], base, "cpu")
        if n != "ddp":
            measured[f"{n}/ddp fp32"] = (wall_r, cpu_r)
        st = f"{states[n] / 2**20:.1f}" if states[n] else "-"
        lines.append(
            f"| {LABELS.get(n, n)} | {_timing.fmt_iqr(_timing.step_quartiles(recs[n], 'wall'), 1e3, 0)} "
            f"| {_timing.fmt_iqr(_timing.step_quartiles(recs[n], 'cpu'), 1e3, 0)} "
            f"| {_timing.fmt_iqr(wall_r)} | {_timing.fmt_iqr(cpu_r)} | {st} "
            f"| {syncs_cell({'syncs': [r['syncs'][n] for r in res if 'syncs' in r]})} |"
        )
    lines += [
        "",
        "## Where the time goes (median ms per step, both ranks)",
        "",
        _timing.PHASE_LEGEND,
        "",
        "| variant | forward wall | backward cpu (compute + hooks) | backward wait | step cpu | step wait "
        "| reduce (gloo) | gather (gloo) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        ph = _timing.phase_medians(recs[n])
        comm = {k: sorted(r["comm"][n][k] for r in res)[len(res) // 2] for k in ("reduce", "gather")}
        fw, (bw, bc), (sw, sc) = ph["forward"][0], ph["backward"], ph["step"]
        lines.append(
            f"| {LABELS.get(n, n)} | {fw * 1e3:.0f} | {bc * 1e3:.0f} | {(bw - bc) * 1e3:.0f} | {sc * 1e3:.0f} "
            f"| {(sw - sc) * 1e3:.0f} | {comm['reduce'] * 1e3:.0f} | {comm['gather'] * 1e3:.0f} |"
        )
    return lines, measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="steps of each variant per pass")
    ap.add_argument("--out", default=str(ROOT / "tools" / "bench" / "results" / "bench_zero12.md"))
    ap.add_argument("--deepspeed-path", default=None, help="folder holding deepspeed (pip --target)")
    ap.add_argument("--check", action="store_true", help="compare the README's quoted ratios with a new run")
    ap.add_argument(
        "--memory-only",
        action="store_true",
        help="only the model-state bytes at N = 2 and 4 (deterministic; no timing), to "
        "tools/bench/results/bench_zero12_memory.md unless --out is given",
    )
    args = ap.parse_args()
    if args.steps < 1 or args.passes < 5:
        raise SystemExit("--steps must be >= 1 and --passes >= 5 (quartiles of fewer ratios mean little)")
    from zero_core.testing import run_multirank

    if args.memory_only:
        _memory_only(args, run_multirank)
        return
    names = ["ddp", "stage0", "stage1", "stage2"] + (["ds1", "ds2"] if args.deepspeed_path else [])
    commit = git_commit("packages/zero-core", "tools/bench")  # the code measured: read before the run
    load = _timing.LoadLog()
    t_start = time.perf_counter()
    res = run_multirank(
        _timed_rank, 2, args=(names, args.passes, args.steps, args.deepspeed_path), timeout=1800
    )
    elapsed = time.perf_counter() - t_start
    load.sample()
    table, measured = _time_tables(res, names)
    if args.check:
        lines, ok = _timing.check_lines(_timing.readme_quotes(ROOT / "README.md", "bench_zero12"), measured)
        print("\n".join(lines + [f"load: {load.describe()}", "check: " + ("ok" if ok else "FAILED")]))
        sys.exit(0 if ok else 1)
    versions = f"python {platform.python_version()}, torch {torch.__version__}"
    if args.deepspeed_path:
        sys.path.insert(0, args.deepspeed_path)
        import deepspeed

        versions += f", deepspeed {deepspeed.__version__} (DS_ACCELERATOR=cpu)"
    ds_flag = f" --deepspeed-path {args.deepspeed_path}" if args.deepspeed_path else ""
    lines = [
        "# bench_zero12: ZeRO stages 0/1/2 vs torch DDP"
        + (" and DeepSpeed" if ds_flag else "")
        + " (CPU, gloo)",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}",
        f"- load: {load.describe()}",
        f"- versions: {versions}",
        f"- git commit: {commit}",
        f"- command: `OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_zero12.py --passes {args.passes} "
        f"--steps {args.steps}{ds_flag}`",
        f"- model: examples/gpt.py GPT d_model 256, 4 layers, seq 128, Ψ = {res[0]['params']:,} parameters; "
        f"micro-batch {MICRO} per rank; Adam lr 1e-4; no clipping; buckets {BUCKET:,} elements; overlap_comm on; fp32",
        f"- every variant built in the same 2 forked ranks; {args.passes} passes, each running every variant "
        f"for {args.steps} steps in turn (after 1 warm-up step each); a ratio per pass (median step of the "
        "pass over both ranks / DDP's in that pass); tables give the median and interquartile range "
        "of those ratios. CPU = process CPU time of a rank (all its threads)",
        f"- benchmark wall time: {elapsed:.0f} s",
        "",
        "## 2 ranks, fp32: step time per rank and ratios vs DDP",
        "",
        *table,
        "",
    ]
    text = "\n".join(lines)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
