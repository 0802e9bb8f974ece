"""Step time and per-rank memory of ZeRO stages 0, 1, 2 against torch DDP (2 ranks, gloo, CPU).

Same GPT (examples/gpt.py), same micro-batch, same Adam, every variant in its own pair of
forked ranks (so peak RSS is per variant). Step time = forward + backward + optimizer step,
median over the timed steps after warm-up; ratios are against DDP measured in the same run.
Model-state bytes come from live tensors (``engine.memory_breakdown()``; for DDP the
parameters, gradients and Adam states). A second pass at 4 ranks reports model-state bytes
only (bf16 + Adam, the setting of the ZeRO paper's formulas, and fp32).

DeepSpeed side by side: when ``--ds-python`` (default /tmp/dsvenv/bin/python: a virtual
environment holding DeepSpeed 0.19.8 and the same torch) exists, the same script runs there with ``--deepspeed-worker``
in its own 2-rank launch: torch DDP, DeepSpeed stage 1 and stage 2 (fp32, client torch Adam,
``gradient_clipping: 0``), interleaved twice; its ratios are against the DDP of that launch.
Model states there are the bytes of all live tensors (gc) after backward, for DDP too.

Run: OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_zero12.py [--steps 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(d_model=256, n_layers=4, n_heads=4, seq_len=128))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randint(0, 256, (MICRO, 129), generator=g)
    return x[:, :-1], x[:, 1:]


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _variant(name: str, steps: int, precision: str = "fp32", time_it: bool = True) -> dict:
    import zero_core
    from zero_core import comm

    rank = comm.get_rank()
    model = _model()
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, bucket_cap_mb=BUCKET * 4 / 2**20)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step_fn(s: int) -> None:
            x, y = _batch(s, rank)
            ddp(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)  # keep gradients: they are part of DDP's model states

        def states() -> int:
            st = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
            return _bytes(model.parameters()) + _bytes(p.grad for p in model.parameters()) + _bytes(st)
    else:
        stage = int(name[-1])
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 10**9,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}},
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": BUCKET,
                "allgather_bucket_size": BUCKET,
                "overlap_comm": True,
            },
        }
        if precision != "fp32":
            cfg[precision] = {"enabled": True}
        engine = zero_core.initialize(model=model, config=cfg)[0]
        peak = {"states": 0}

        def step_fn(s: int) -> None:
            x, y = _batch(s, rank)
            engine.backward(engine(x, y))
            peak["states"] = max(peak["states"], sum(engine.memory_breakdown().values()))
            engine.step()

        def states() -> int:
            return peak["states"]

    times = []
    for s in range(steps + 2):
        comm.barrier()
        t = time.perf_counter()
        step_fn(s)
        if s >= 2:
            times.append(time.perf_counter() - t)
        if not time_it and s >= 1:
            break
    return {
        "syncs": host_syncs_per_step(step_fn, steps + 2) if time_it else None,
        "times": times,
        "states": states(),
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "params": sum(p.numel() for p in model.parameters()),
    }


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every live tensor (model states once activations are freed)."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not torch.is_tensor(obj) or obj.device.type != "cpu" or obj.numel() == 0:
                continue
            st = obj.untyped_storage()
        except Exception:  # noqa: BLE001 - some tensor subclasses refuse storage access
            continue
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _ds_variant(name: str, steps: int, rank: int) -> dict:
    """One DeepSpeed-venv variant in this rank: 'ddp', 'ds1' or 'ds2' (fp32)."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, bucket_cap_mb=BUCKET * 4 / 2**20)

        def fwd_bwd(s: int) -> None:
            ddp(*_batch(s, rank)).backward()

        def finish() -> None:
            opt.step()
            opt.zero_grad(set_to_none=False)
    else:
        import deepspeed

        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0,
            "steps_per_print": 10**9,
            "zero_optimization": {
                "stage": int(name[-1]),
                "reduce_bucket_size": BUCKET,
                "allgather_bucket_size": BUCKET,
                "overlap_comm": True,
            },
        }
        engine = deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]

        def fwd_bwd(s: int) -> None:
            engine.backward(engine(*_batch(s, rank)))

        def finish() -> None:
            engine.step()

    times, states = [], 0
    for s in range(steps + 2):
        torch.distributed.barrier()
        t = time.perf_counter()
        fwd_bwd(s)
        if s == 1:
            states = _live_tensor_bytes()
        finish()
        if s >= 2:
            times.append(time.perf_counter() - t)
    syncs = host_syncs_per_step(lambda s: (fwd_bwd(s), finish()), steps + 2)
    return {"times": times, "states": states, "syncs": syncs}


def _ds_rank(rank: int, steps: int, port: int, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    import deepspeed

    out = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "rows": {}}
    for _rep in range(2):
        for name in ("ddp", "ds1", "ds2"):
            res = _ds_variant(name, steps, rank)
            row = out["rows"].setdefault(name, {"times": [], "states": 0})
            row["times"] += res["times"]
            row["states"] = max(row["states"], res["states"])
            row.setdefault("syncs", []).append(res["syncs"])
            gc.collect()
    queue.put(out)
    torch.distributed.destroy_process_group()


def _deepspeed_worker(steps: int) -> None:
    """Entry point inside the DeepSpeed venv: 2 forked ranks, JSON of both ranks on stdout."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_ds_rank, args=(r, steps, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    print("BENCH_JSON " + json.dumps(results))


def _run_deepspeed(ds_python: str, steps: int) -> list | None:
    if not Path(ds_python).exists():
        return None
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [ds_python, __file__, "--deepspeed-worker", "--steps", str(steps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            return json.loads(line[len("BENCH_JSON ") :])
    raise RuntimeError(f"DeepSpeed side failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def _mem_sweep() -> dict:
    """Model-state bytes of every variant and precision, one after another in these ranks."""
    out = {}
    for precision in ("bf16", "fp32"):
        for name in ("ddp", "stage0", "stage1", "stage2"):
            if name == "ddp" and precision == "bf16":
                continue
            out[f"{name}/{precision}"] = _variant(name, 1, precision, False)["states"]
            gc.collect()
    return out


def _memory_table(mem: dict[int, list[dict]]) -> list[str]:
    per_n = {n: {k: max(r[k] for r in res) for k in res[0]} for n, res in mem.items()}
    lines = []
    for key in per_n[2]:
        name, precision = key.split("/")
        cells = []
        for n in (2, 4):
            b, base_b = per_n[n][key], per_n[n]["ddp/fp32"]
            cells.append(f"{b / 2**20:.1f} | {b / base_b:.2f}")
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
        "| variant | precision | N=2 (MiB) | ratio vs DDP | N=4 (MiB) | ratio vs DDP |",
        "|---|---|---|---|---|---|",
        *_memory_table(mem),
        "",
        "Measured after backward (peak over the step). DDP: parameters + gradients + Adam states (fp32), "
        "its own bucket copies not counted. Stage 0's gradients live in its bucket buffers and count once.",
        "",
    ]
    with open(out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "tools" / "bench" / "results" / "bench_zero12.md"))
    ap.add_argument("--ds-python", default="/tmp/dsvenv/bin/python")
    ap.add_argument("--deepspeed-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--memory-only",
        action="store_true",
        help="only the model-state bytes at N = 2 and 4 (deterministic; no timing), to "
        "tools/bench/results/bench_zero12_memory.md unless --out is given",
    )
    args = ap.parse_args()
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    if args.deepspeed_worker:
        _deepspeed_worker(args.steps)
        return
    from zero_core.testing import run_multirank  # not in the DeepSpeed venv: imported here

    if args.memory_only:
        _memory_only(args, run_multirank)
        return
    t_start = time.perf_counter()

    rows = {}
    for _rep in range(2):  # interleave two passes: the machine is shared and noisy
        for name in ("ddp", "stage0", "stage1", "stage2"):
            res = run_multirank(_variant, 2, args=(name, args.steps), timeout=600)
            r = rows.setdefault(name, {"times": [], "states": 0, "rss": 0, "params": res[0]["params"]})
            for rr in res:
                r["times"] += rr["times"]
                r["states"] = max(r["states"], rr["states"])
                r["rss"] = max(r["rss"], rr["rss"])
                r.setdefault("syncs", []).append(rr["syncs"])
    mem = {n: run_multirank(_mem_sweep, n, timeout=600) for n in (2, 4)}
    ds = _run_deepspeed(args.ds_python, args.steps)
    elapsed = time.perf_counter() - t_start

    psi = rows["ddp"]["params"]
    base = statistics.median(rows["ddp"]["times"])
    lines = [
        "# bench_zero12: ZeRO stages 0/1/2 vs torch DDP (CPU, gloo)",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- git commit: {git_commit('packages/zero-core', 'tools/bench/bench_zero12.py')}",
        f"- command: `OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_zero12.py --steps {args.steps}`",
        f"- model: examples/gpt.py GPT d_model 256, 4 layers, seq 128, Ψ = {psi:,} parameters; micro-batch {MICRO} "
        f"per rank; Adam; buckets {BUCKET:,} elements; overlap_comm on; fp32",
        "- each variant ran twice (interleaved) on 2 forked ranks; times pooled over ranks and passes",
        f"- benchmark wall time: {elapsed:.0f} s",
        "- host syncs/step: device values read on the host per training step, counted on extra untimed "
        "steps (tools/bench/host_syncs_column.py), max over ranks",
        "",
        "## 2 ranks, fp32: step time and memory per rank",
        "",
        "| variant | median step (ms) | p10-p90 (ms) | ratio vs DDP | model states/rank (MiB) | ratio | peak RSS/rank (MiB) "
        "| host syncs/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        t = sorted(r["times"])
        med = statistics.median(t)
        p10, p90 = t[int(0.1 * (len(t) - 1))], t[int(0.9 * (len(t) - 1))]
        lines.append(
            f"| {name} | {med * 1e3:.1f} | {p10 * 1e3:.1f}-{p90 * 1e3:.1f} | {med / base:.2f} | "
            f"{r['states'] / 2**20:.1f} | {r['states'] / rows['ddp']['states']:.2f} | {r['rss'] / 2**20:.0f} |"
            f" {syncs_cell(r)} |"
        )
    lines += [
        "",
        "## Model-state bytes per rank at N = 2 and N = 4 (engine.memory_breakdown(), max over ranks)",
        "",
        "Adam; bucket buffers included. DDP: parameters + gradients + Adam states (fp32).",
        "",
        "| variant | precision | N=2 (MiB) | ratio vs DDP | N=4 (MiB) | ratio vs DDP |",
        "|---|---|---|---|---|---|",
    ]
    lines += _memory_table(mem)
    lines += [
        "",
        "## DeepSpeed side by side (its own 2-rank launch, fp32, ratios vs the DDP of that launch)",
        "",
    ]
    if ds is None:
        lines.append(f"DeepSpeed venv not found at {args.ds_python}: not run.")
    else:
        lines += [
            f"- venv: {args.ds_python}; deepspeed {ds[0]['deepspeed']}, torch {ds[0]['torch']}; "
            "DS_ACCELERATOR=cpu, gloo; client torch.optim.Adam; gradient_clipping 0; overlap_comm on; same buckets",
            "- model states = bytes of all live tensors (gc) after backward, max over ranks",
            "",
            "| variant | median step (ms) | p10-p90 (ms) | ratio vs DDP | model states/rank (MiB) | ratio "
            "| host syncs/step |",
            "|---|---|---|---|---|---|---|",
        ]
        ds_rows = {
            name: {
                "times": [t for r in ds for t in r["rows"][name]["times"]],
                "states": max(r["rows"][name]["states"] for r in ds),
                "syncs": [x for r in ds for x in r["rows"][name].get("syncs", [])],
            }
            for name in ds[0]["rows"]
        }
        ds_base = statistics.median(ds_rows["ddp"]["times"])
        labels = {"ddp": "ddp", "ds1": "DeepSpeed stage 1", "ds2": "DeepSpeed stage 2"}
        for name, r in ds_rows.items():
            t = sorted(r["times"])
            med = statistics.median(t)
            p10, p90 = t[int(0.1 * (len(t) - 1))], t[int(0.9 * (len(t) - 1))]
            lines.append(
                f"| {labels[name]} | {med * 1e3:.1f} | {p10 * 1e3:.1f}-{p90 * 1e3:.1f} | {med / ds_base:.2f} | "
                f"{r['states'] / 2**20:.1f} | {r['states'] / ds_rows['ddp']['states']:.2f} | {syncs_cell(r)} |"
            )
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
