"""The main job: train a small byte-level GPT on the Python standard library's sources.

    zero run --nproc 2 examples/train_gpt.py --zero_config examples/configs/stage0.json

Prints a progress line every ``steps_per_print`` steps (loss, samples/s, model-state MB per
rank), writes TensorBoard logs, saves a checkpoint at the end and prints where everything went.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zero  # noqa: E402
from gpt import GPT, ByteDataset, GPTConfig, num_params, stdlib_corpus  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to run")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--n_layers", type=int, default=4)
    p.add_argument("--n_heads", type=int, default=4)
    p.add_argument("--out_dir", default="outputs/train_gpt", help="TensorBoard logs and checkpoints")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--corpus_bytes", type=int, default=4_000_000)
    p.add_argument("--no_save", action="store_true", help="skip the final checkpoint")
    zero.add_config_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    cfg_path = args.zero_config or args.deepspeed_config
    if cfg_path is None:
        raise SystemExit("train_gpt.py: --zero_config PATH is required (see examples/configs/)")
    if not os.path.isfile(cfg_path):
        raise SystemExit(f"train_gpt.py: --zero_config {cfg_path!r} is not a file (see examples/configs/)")
    with open(cfg_path) as f:
        config = json.load(f)
    # Logs go under --out_dir unless the config says otherwise.
    for section in ("tensorboard", "csv_monitor"):
        if config.get(section, {}).get("enabled"):
            config[section].setdefault("output_path", os.path.join(args.out_dir, section))
    model_cfg = GPTConfig(
        seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads
    )
    model = GPT(model_cfg)
    n_params = num_params(model)  # the model's size, counted before ZeRO partitions it
    dataset = ByteDataset(stdlib_corpus(args.corpus_bytes), args.seq_len)
    engine, _, loader, _ = zero.initialize(model=model, config=config, training_data=dataset)
    rank = zero.comm.get_rank()
    if rank == 0:
        print(
            f"[train_gpt] {n_params / 1e6:.2f}M parameters, {len(dataset)} windows of {args.seq_len} bytes, "
            f"world size {zero.comm.get_world_size()}, global batch {engine.train_batch_size()}, "
            f"config {cfg_path}",
            flush=True,
        )
    losses: list[float] = []
    start = time.perf_counter()
    data_iter = iter(zero.utils.RepeatingLoader(loader))
    while engine.global_steps < args.steps:
        x, y = next(data_iter)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if engine.micro_steps % engine.gradient_accumulation_steps() == 0:
            losses.append(engine.last_loss)
    elapsed = time.perf_counter() - start
    ckpt_dir = os.path.join(args.out_dir, "checkpoints")
    if not args.no_save:
        engine.save_checkpoint(ckpt_dir)
    if rank == 0:
        print(
            f"[train_gpt] done: {engine.global_steps} steps in {elapsed:.1f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}",
            flush=True,
        )
        if config.get("tensorboard", {}).get("enabled"):
            print(f"[train_gpt] TensorBoard logs: {config['tensorboard']['output_path']}", flush=True)
        if not args.no_save:
            print(f"[train_gpt] checkpoint: {ckpt_dir}", flush=True)
    return {
        "losses": losses,
        "elapsed": elapsed,
        "params": n_params,
        "params_after_initialize": num_params(model),
        "memory": engine.memory_breakdown(),
    }


if __name__ == "__main__":
    main()
