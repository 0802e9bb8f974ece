"""Cross-node bytes and step time of MiCS and ZeRO++ against plain stage 3 and FSDP2's HSDP (4 ranks as 2 x 2).

Four forked ranks on one machine stand for 2 nodes x 2 ranks (``ZERO_RANKS_PER_NODE=2``, see
[Note: node topology]). Every variant trains the same GPT (examples/gpt.py) in bf16 with Adam on
the same batches; each runs in its own four forked ranks, variants alternate within a pass and
the passes repeat (the machine is shared and noisy: compare ratios from one launch only).

Variants (``--variants``, comma-separated; default: the ones this build implements):

* ``zero3``: plain stage 3; ``mics``: ``mics_shard_size`` 2 (shard groups inside the nodes);
  ``mics_hier``: ``mics_shard_size`` 4 with ``mics_hierarchical_params_gather``; ``hpz``:
  ``zero_hpz_partition_size`` 2;
* ``qwz``: ``zero_quantized_weights``; ``qgz``: ``zero_quantized_gradients``; ``zeropp``: qwZ +
  hpZ + qgZ (the ZeRO++ paper's setting); ``all`` in ``--variants`` adds these three;
* ``hsdp``: FSDP2 ``fully_shard`` per block then root on a 2-D DeviceMesh (replicate 2 x shard
  2, the shard dimension inside a node): MiCS's peer.

Bytes: per rank and step, split into inside-node and cross-node with the model of [Note: bytes
by link class] (the bytes a rank sends, as a direct exchange). For zero that is the comms
logger's ``bytes_by_link()``; for HSDP the same function applied to every collective FSDP2 issues
(``torch.distributed.all_gather_single``, ``reduce_scatter_single`` and ``all_reduce`` are
wrapped while it runs), so both columns use one model. Stage 3's agreement checks are off (their
32-byte headers are not training traffic), ``param_persistence_threshold`` and ``max_reuse_distance``
are 0 (like FSDP2's default ``reshard_after_forward``, every module's weights are released after its
forward and gathered again for its backward), so plain stage 3 moves exactly its three collectives
of Ψ.

Run: OMP_NUM_THREADS=1 hatch run python tools/bench/bench_zeropp.py [--steps 3] [--passes 2]
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
from bench_env import cpu_model, fork_ranks, git_commit

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_gpt", ROOT / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
sys.modules["bench_gpt"] = gpt
_spec.loader.exec_module(gpt)

WORLD, PER_NODE, MICRO = 4, 2, 4
BASE = {
    "stage": 3,
    "reduce_bucket_size": 5_000_000,
    "prefetch_bucket_size": 5_000_000,
    "param_persistence_threshold": 0,
    "max_reuse_distance": 0,
    "overlap_comm": True,
}
VARIANTS: dict[str, dict] = {
    "zero3": {},
    "mics": {"mics_shard_size": 2},
    "mics_hier": {"mics_shard_size": 4, "mics_hierarchical_params_gather": True},
    "hpz": {"zero_hpz_partition_size": 2},
    "qwz": {"zero_quantized_weights": True},
    "qgz": {"zero_quantized_gradients": True},
    "zeropp": {
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 2,
        "zero_quantized_gradients": True,
    },
    "hsdp": {},
}
DEFAULT = ["zero3", "mics", "mics_hier", "hpz", "hsdp"]
QUANTIZED = ["qwz", "qgz", "zeropp"]
OUT = ROOT / "tools" / "bench" / "results" / "bench_zeropp.md"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(d_model=256, n_layers=4, n_heads=8, seq_len=128))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randint(0, 256, (MICRO, 129), generator=g)
    return x[:, :-1], x[:, 1:]


class _TorchLinkCounter:
    """Counts FSDP2's collectives by link class with zero's model, by wrapping torch.distributed."""

    NAMES = {
        "all_gather_single": "all_gather_into_tensor",
        "reduce_scatter_single": "reduce_scatter_tensor",
        "all_reduce": "all_reduce",
    }

    def __init__(self) -> None:
        self.intra = self.inter = 0
        self.on = False

    def install(self) -> None:
        import torch.distributed as dist
        from zero_core.comm.link_bytes import split_by_link

        me = dist.get_rank()
        for fn_name, op in self.NAMES.items():
            orig = getattr(dist, fn_name)

            def wrapped(*args, _orig=orig, _op=op, **kwargs):
                if self.on:
                    tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
                    size = max(t.numel() * t.element_size() for t in tensors)
                    group = kwargs.get("group")
                    ranks = dist.get_process_group_ranks(group) if group is not None else range(WORLD)
                    a, b = split_by_link(_op, tuple(ranks), me, PER_NODE, size)
                    self.intra, self.inter = self.intra + a, self.inter + b
                return _orig(*args, **kwargs)

            setattr(dist, fn_name, wrapped)


def _variant(name: str, steps: int) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = _model()
    psi = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if name == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        counter = _TorchLinkCounter()
        counter.install()
        mesh = init_device_mesh("cpu", (WORLD // PER_NODE, PER_NODE), mesh_dim_names=("replicate", "shard"))
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step_fn(s: int) -> None:
            x, y = _batch(s, rank)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()

        def links() -> tuple[int, int]:
            return counter.intra, counter.inter

        def count(on: bool) -> None:
            counter.on = on
    else:
        import zero_core
        from zero_core.comm import comms_logger
        from zero_core.zero.stage3 import set_collective_checks

        set_collective_checks(False)
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 10**9,
            "gradient_clipping": 0.0,
            "bf16": {"enabled": True},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}},
            "zero_optimization": {**BASE, **VARIANTS[name]},
        }
        engine = zero_core.initialize(model=model, config=cfg)[0]

        def step_fn(s: int) -> None:
            x, y = _batch(s, rank)
            engine.backward(engine(x, y))
            engine.step()

        def links() -> tuple[int, int]:
            got = comms_logger.bytes_by_link()
            return got["intra_node"], got["inter_node"]

        def count(on: bool) -> None:
            if on:
                comms_logger.enable()
            else:
                comms_logger.disable()

    times = []
    for s in range(steps + 1):
        count(s >= 1)
        dist.barrier()
        t = time.perf_counter()
        step_fn(s)
        if s >= 1:
            times.append(time.perf_counter() - t)
    count(False)
    intra, inter = links()
    return {"times": times, "psi": psi, "intra": intra / steps, "inter": inter / steps}


def _run(names: list[str], steps: int, passes: int) -> tuple[dict, list[float]]:
    rows: dict = {}
    loads: list[float] = []
    for _ in range(passes):
        for name in names:
            loads.append(os.getloadavg()[0])
            res = fork_ranks(_variant, (name, steps), WORLD, per_node=PER_NODE, timeout=900)
            r = rows.setdefault(name, {"times": [], "psi": res[0]["psi"], "intra": [], "inter": []})
            for rr in res:
                r["times"] += rr["times"]
                r["intra"].append(rr["intra"])
                r["inter"].append(rr["inter"])
            med = statistics.median(r["times"])
            print(
                f"{name}: median step {med * 1e3:.0f} ms, cross-node {max(r['inter']) / 2**20:.2f} MiB/rank/step",
                file=sys.stderr,
                flush=True,
            )
    loads.append(os.getloadavg()[0])
    return rows, loads


def _expected(name: str, psi: int) -> str:
    """Cross-node bytes per rank and step by the formulas (bf16 weights and gradients)."""
    b = 2 * psi  # Ψ in bytes
    far = (WORLD - PER_NODE) / WORLD
    formulas = {
        "zero3": 3 * b * far,
        "hpz": 2 * b * far,
        "mics": 2 * (b / 2) / 2,
        "mics_hier": 2 * (b / 4) + b * far,
        "hsdp": 2 * (b / 2) / 2,
    }
    return f"{formulas[name] / 2**20:.2f}" if name in formulas else "-"


def _table(rows: dict) -> list[str]:
    lines = [
        "| variant | cross-node MiB/rank/step | formula | inside-node MiB/rank/step | cross-node vs zero3 "
        "| cross-node vs hsdp | median step (ms) | min-max (ms) | step vs zero3 | step vs hsdp |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = rows.get("zero3")
    hsdp = rows.get("hsdp")
    for name, r in rows.items():
        inter, intra = max(r["inter"]), max(r["intra"])
        med = statistics.median(r["times"])

        def ratio(ref: dict | None, mine: float, key: str) -> str:
            if ref is None:
                return "-"
            other = max(ref[key]) if key != "times" else statistics.median(ref["times"])
            return f"{mine / other:.3f}" if other else "-"

        lines.append(
            f"| {name} | {inter / 2**20:.2f} | {_expected(name, r['psi'])} | {intra / 2**20:.2f} "
            f"| {ratio(base, inter, 'inter')} | {ratio(hsdp, inter, 'inter')} | {med * 1e3:.0f} "
            f"| {min(r['times']) * 1e3:.0f}-{max(r['times']) * 1e3:.0f} | {ratio(base, med, 'times')} "
            f"| {ratio(hsdp, med, 'times')} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--variants", default=",".join(DEFAULT), help="comma-separated; 'all' = every variant")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    if a.steps < 1 or a.passes < 1:
        raise SystemExit("--steps and --passes must be >= 1")
    names = list(VARIANTS) if a.variants == "all" else [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; allowed: {list(VARIANTS)} or 'all'")
    t0 = time.perf_counter()
    rows, loads = _run(names, a.steps, a.passes)
    wall = time.perf_counter() - t0
    psi = next(iter(rows.values()))["psi"]
    lines = [
        "# bench_zeropp: MiCS and ZeRO++ vs plain stage 3 and FSDP2 HSDP (CPU, gloo, 4 ranks as 2 nodes x 2)",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}; shared with other jobs "
        "(4 ranks time-share the cores: step times are not those of a real 2-node cluster, only their ratios "
        "within this run mean anything)",
        f"- load average (1 min) before each launch: min {min(loads):.1f}, median {statistics.median(loads):.1f}, "
        f"max {max(loads):.1f} ({len(loads)} samples over {wall:.0f} s)",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- git commit: {git_commit('packages/zero-core', 'tools/bench/bench_zeropp.py')}",
        f"- command: `OMP_NUM_THREADS=1 hatch run python tools/bench/bench_zeropp.py --steps {a.steps} "
        f"--passes {a.passes} --variants {a.variants}`",
        f"- model: examples/gpt.py GPT d_model 256, 4 layers, 8 heads, seq 128, Ψ = {psi:,}; micro-batch "
        f"{MICRO} per rank; bf16, Adam lr 1e-4; zero_optimization {BASE} plus the variant's keys "
        f"{ {n: VARIANTS[n] for n in names if n != 'hsdp'} }",
        "- hsdp: FSDP2 fully_shard per block then root, DeviceMesh (replicate 2, shard 2) with the shard groups "
        "inside the nodes, MixedPrecisionPolicy(bf16, bf16)",
        "- bytes: what each rank sends per step, by [Note: bytes by link class] (direct exchange; the max over "
        "ranks and passes, which agree); 'formula' is the cross-node figure the design predicts "
        "(zero3 3·2Ψ·(N-L)/N, hpz 2·2Ψ·(N-L)/N, mics and hsdp 2Ψ/S·(R-1)/R·2 with R replicas, "
        "mics_hier 2·(2Ψ/S)·(M-1) for the two first hops + the reduce-scatter 2Ψ·(N-L)/N)",
        f"- {a.passes} passes; each variant runs once per pass in its own 4 forked ranks; {a.steps} timed "
        "steps after 1 warm-up; step times pooled over ranks and passes",
        "- the 'nodes' share one machine, so their 'cross-node' link is as fast as the inside one: step times "
        "here show each layout's extra work (copies, second hops, replica all-reduces), not the time a slow "
        "cross-node link would save; the cross-node bytes are what carries over to a real cluster",
        *(
            [
                "- not run: the quantized switches ("
                + ", ".join(q for q in QUANTIZED if q not in names)
                + "); "
                "`--variants all` runs every variant"
            ]
            if any(q not in names for q in QUANTIZED)
            else []
        ),
        "",
        *_table(rows),
    ]
    text = "\n".join(lines) + "\n"
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
