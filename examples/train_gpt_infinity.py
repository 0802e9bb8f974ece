"""Train a GPT whose model states do not fit in this machine's memory (ZeRO-Infinity, stage 3 on NVMe).

    zero run --nproc 2 examples/train_gpt_infinity.py --d_model 2560 --n_layers 24 --n_heads 20 \\
        --nvme_path /work/nvme_swap --ckpt_dir /work/bigckpt --fp32_out /work/bigckpt_fp32 \\
        --max_rss_gib 12 --results outputs/train_gpt_infinity.json

The model is built inside ``zero.Init(remote_device="nvme")``: each submodule's parameters are
cut to this rank's shard and written to the swap folder as soon as its ``__init__`` returns, so
no rank ever holds the model (the fp32 masters, gradients and optimizer states are streamed
through swap files too: [Note: ZeRO-Infinity streaming] in zero-offload). It then trains
``--steps`` steps on the Python standard library's sources (the loss of a held-out window is
printed before and after), saves a checkpoint, loads it back
and, with ``--fp32_out``, converts it with ``zero_to_fp32`` (rank 0, streaming).

Before anything, the free space of ``--nvme_path`` and ``--ckpt_dir`` is checked against what the
run will write (swap files ~18 bytes per parameter in bf16, checkpoint ~14, fp32 file 4); a short
disk fails with the folder and the bytes needed. Every phase reports its wall time and each
rank's peak RSS (``rss_phases.py``); the progress line shows the step time, the swap traffic and
throughput, and RSS (growth is measured from a baseline taken after a one-step warm-up on a tiny
model, which loads the modules and kernels every run needs). ``--max_rss_gib`` fails the run (exit code 3) if any phase's summed per-rank
peak exceeds it. ``--results`` writes the figures as JSON. Swap files are removed when the
engine is destroyed (and on SIGTERM or any exit: [Note: swap file lifecycle]).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zero  # noqa: E402
from gpt import GPT, ByteDataset, GPTConfig, stdlib_corpus  # noqa: E402
from rss_phases import PhaseMeter, rss_bytes  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--n_layers", type=int, default=8)
    p.add_argument("--n_heads", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--nvme_path", required=True, help="folder for the swap files (on a local disk)")
    p.add_argument("--ckpt_dir", required=True, help="folder for the checkpoint")
    p.add_argument(
        "--fp32_out", default=None, help="convert the checkpoint with zero_to_fp32 into this folder"
    )
    p.add_argument(
        "--max_rss_gib", type=float, default=None, help="fail if a phase's summed peak RSS exceeds it"
    )
    p.add_argument("--results", default=None, help="write the phase figures here (JSON)")
    p.add_argument("--cleanup", action="store_true", help="delete the checkpoint and fp32 output at the end")
    p.add_argument("--seed", type=int, default=1234)
    zero.add_config_arguments(p)
    args = p.parse_args(argv)
    if args.zero_config is None and args.deepspeed_config is None:
        args.zero_config = os.path.join(_HERE, "configs", "infinity_nvme.json")
    return args


def gpt_params(cfg: GPTConfig) -> int:
    """Parameters of ``GPT(cfg)`` (tied head counted once), without building it."""
    d = cfg.d_model
    block = 4 * d + 3 * d * d + 3 * d + d * d + d + 4 * d * d + 4 * d + 4 * d * d + d
    return cfg.vocab_size * d + cfg.seq_len * d + cfg.n_layers * block + 2 * d


def disk_plan(params: int, args: argparse.Namespace) -> dict[str, int]:
    """Bytes each folder needs at its fullest, and check that it is free (a clear error if not).

    Swap (all ranks): bf16 parameters 2 + fp32 masters 4 + gradients 4 + Adam states 8 bytes per
    parameter; checkpoint: bf16 weights 2 + masters 4 + states 8; zero_to_fp32's file: 4 (written
    after the engine, and its swap files, are gone). 2 % slack for alignment and metadata."""
    from zero.offload import check_free_space

    swap, ckpt, fp32 = 18 * params, 14 * params, (4 * params if args.fp32_out else 0)
    swap, ckpt, fp32 = (int(x * 1.02) + (64 << 20) for x in (swap, ckpt, fp32))
    folders = {"swap": os.path.abspath(args.nvme_path), "checkpoint": os.path.abspath(args.ckpt_dir)}
    same = _device(folders["swap"]) == _device(folders["checkpoint"])
    need = {"swap": swap + (ckpt if same else 0), "checkpoint": ckpt if same else ckpt + fp32}
    if same:
        need["swap"] = max(need["swap"], ckpt + fp32)
    for key, folder in folders.items():
        if key == "checkpoint" and same:
            continue
        what = "train_gpt_infinity: swap files and checkpoint" if same else f"train_gpt_infinity: {key}"
        check_free_space(folder, need[key], what)
    return {"swap_bytes": swap, "checkpoint_bytes": ckpt, "fp32_bytes": fp32, "same_disk": int(same)}


def _device(path: str) -> int:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.stat(path).st_dev


def load_config(args: argparse.Namespace) -> dict:
    with open(args.zero_config or args.deepspeed_config) as f:
        config = json.load(f)
    zc = config.setdefault("zero_optimization", {})
    for key in ("offload_param", "offload_optimizer"):
        zc.setdefault(key, {})["nvme_path"] = args.nvme_path  # --nvme_path wins over the file
    return config


def warm_up(config: dict, seq_len: int) -> None:
    """Train a tiny GPT one step with the same config, then drop it: the modules and kernels a
    run loads once (the engine, zero-offload, torch's optimizer machinery, about 100 MB of RSS)
    are in place before the memory baseline, so each phase's growth is what the model costs."""
    tiny = GPT(GPTConfig(seq_len=seq_len, d_model=32, n_layers=1, n_heads=2))
    engine, *_ = zero.initialize(model=tiny, config=config)
    try:
        x = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), seq_len))
        engine.backward(engine(x, x))
        engine.step()
    finally:
        engine.destroy()


def gathered(values: list[float]) -> torch.Tensor:
    """Every rank's ``values`` (rows), on every rank."""
    from zero_core.accelerator import get_accelerator

    device = get_accelerator().current_device_name()
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = torch.empty(zero.comm.get_world_size() * len(values), dtype=torch.float64, device=device)
    zero.comm.all_gather_into_tensor(out, mine)
    return out.view(zero.comm.get_world_size(), len(values)).cpu()


@torch.no_grad()
def held_out_loss(engine: Any, dataset: ByteDataset) -> float:
    """The loss on the corpus's last window (a batch no step trains on; the same on every rank)."""
    x, y = dataset[len(dataset) - 1]
    engine.eval()
    try:
        return float(engine(x[None], y[None]))
    finally:
        engine.train()


def train(
    engine: Any, loader: torch.utils.data.DataLoader, args: argparse.Namespace, meter: PhaseMeter
) -> list[float]:
    losses, io_before = [], engine.strategy.swap_io_bytes()
    data = iter(zero.utils.RepeatingLoader(loader))
    for i in range(args.steps):
        with meter.phase(f"step {i + 1}"):
            x, y = next(data)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(engine.last_loss))
        io = engine.strategy.swap_io_bytes()
        moved = [io["read"] - io_before["read"], io["written"] - io_before["written"]]
        io_before = io
        rows = gathered([*moved, meter.phases[-1].peak, rss_bytes(), meter.phases[-1].seconds])
        if zero.comm.get_rank() == 0:
            read, written = rows[:, 0].sum().item(), rows[:, 1].sum().item()
            secs = rows[:, 4].max().item()
            peaks = " + ".join(f"{v / GIB:.2f}" for v in rows[:, 2].tolist())
            print(
                f"[infinity] step {i + 1}/{args.steps} | loss {losses[-1]:.4f} | {secs:.1f} s/step | swap read "
                f"{read / 1e9:.2f} GB, written {written / 1e9:.2f} GB ({(read + written) / 1e9 / secs:.2f} GB/s) | "
                f"RSS {rows[:, 3].sum().item() / GIB:.2f} GiB (phase peak {peaks} GiB)",
                flush=True,
            )
    return losses


def report(meter: PhaseMeter, args: argparse.Namespace, extra: dict) -> int:
    """Print the phase table on rank 0, write ``--results``; 3 if a phase broke ``--max_rss_gib``."""
    rows = gathered([v for ph in meter.phases for v in (ph.seconds, ph.peak, ph.peak - meter.base)])
    rows = rows.view(rows.shape[0], len(meter.phases), 3)
    phases, over = [], []
    for k, ph in enumerate(meter.phases):
        peaks = rows[:, k, 1].tolist()
        phases.append(
            {
                "phase": ph.name,
                "seconds": rows[:, k, 0].max().item(),
                "peak_rss_per_rank": [int(v) for v in peaks],
                "peak_growth_per_rank": [int(v) for v in rows[:, k, 2].tolist()],
                "peak_rss_sum": int(sum(peaks)),
            }
        )
        if args.max_rss_gib is not None and sum(peaks) > args.max_rss_gib * GIB:
            over.append(ph.name)
    if zero.comm.get_rank() == 0:
        print(f"[infinity] {'phase':<14} {'s':>8} {'peak RSS per rank (GiB)':>26} {'sum':>7}", flush=True)
        for r in phases:
            per = " + ".join(f"{v / GIB:.2f}" for v in r["peak_rss_per_rank"])
            print(f"[infinity] {r['phase']:<14} {r['seconds']:8.1f} {per:>26} {r['peak_rss_sum'] / GIB:7.2f}")
        if args.results:
            os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
            with open(args.results, "w") as f:
                json.dump(
                    {**extra, "max_rss_gib": args.max_rss_gib, "over_ceiling": over, "phases": phases},
                    f,
                    indent=1,
                )
        if over:
            print(
                f"[infinity] FAILED: phases {over} exceeded {args.max_rss_gib} GiB of summed peak RSS",
                flush=True,
            )
    return 3 if over else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    config = load_config(args)
    model_cfg = GPTConfig(
        seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads
    )
    params = gpt_params(model_cfg)
    plan = disk_plan(params, args)
    zero.init_distributed()
    rank = zero.comm.get_rank()
    dataset = ByteDataset(stdlib_corpus(2_000_000), args.seq_len)
    warm_up(config, args.seq_len)
    meter = PhaseMeter()
    if rank == 0:
        print(
            f"[infinity] {params / 1e9:.3f}B parameters (model states {16 * params / 1e9:.1f} GB at 16 bytes each), "
            f"{zero.comm.get_world_size()} ranks; swap {plan['swap_bytes'] / 1e9:.1f} GB in {args.nvme_path}, "
            f"checkpoint {plan['checkpoint_bytes'] / 1e9:.1f} GB in {args.ckpt_dir}",
            flush=True,
        )
    with meter.phase("construct"):
        with zero.Init(config_dict_or_path=config, remote_device="nvme"):
            model = GPT(model_cfg)
    with meter.phase("initialize"):
        engine, _, loader, _ = zero.initialize(model=model, config=config, training_data=dataset)
    try:
        with meter.phase("eval before"):
            eval_before = held_out_loss(engine, dataset)
        losses = train(engine, loader, args, meter)
        with meter.phase("eval after"):
            eval_after = held_out_loss(engine, dataset)
        if rank == 0:
            print(f"[infinity] held-out loss {eval_before:.4f} -> {eval_after:.4f}", flush=True)
        with meter.phase("save"):
            engine.save_checkpoint(args.ckpt_dir, tag="infinity")
        with meter.phase("load"):
            engine.load_checkpoint(args.ckpt_dir, tag="infinity")
        swap_dir = engine.strategy.offload.swap_dir.path
    finally:
        engine.destroy()
    swap_left = os.path.exists(swap_dir)
    if args.fp32_out:
        with meter.phase("zero_to_fp32"):
            if rank == 0:
                zero.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
                    args.ckpt_dir, args.fp32_out, tag="infinity", max_shard_size="2GB", progress=False
                )
            zero.comm.barrier()
    meter.close()
    extra = {
        "parameters": params,
        "losses": losses,
        "held_out_loss": [eval_before, eval_after],
        "swap_left_behind": swap_left,
        **plan,
        "argv": sys.argv,
    }
    code = report(meter, args, extra)
    if args.cleanup and rank == 0:
        for folder in (args.ckpt_dir, args.fp32_out):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
