"""A tiny training script for the fault-injection cases of ``run_faults.py`` (launch it with
``zero run --nproc N``): a few steps of a small token model at a chosen ZeRO stage, with an
optional injected fault.

Faults (``--fault``): ``none``; ``stall`` (rank ``--rank-at-fault`` sleeps before its first
backward, so its peers wait in a collective); ``stage`` / ``micro`` / ``gas`` / ``precision`` /
``model`` (that rank's setup differs from its peers'); ``save-alone`` (only that rank calls
save_checkpoint); ``tags`` (that rank passes another tag; ``--tag-validation`` picks the mode);
``sigterm`` (the script prints ``TRAINING`` each step and trains until killed; NVMe offload of
the optimizer under ``--nvme``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def _config(args: argparse.Namespace, odd: bool) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": args.stage},
        "optimizer": {"type": "Adam" if args.nvme else "SGD", "params": {"lr": 0.01}},
        "checkpoint": {"tag_validation": args.tag_validation},
    }
    if args.comms_timeout:
        cfg["comms_timeout"] = args.comms_timeout
    if odd and args.fault == "stage":
        cfg["zero_optimization"]["stage"] = 3 if args.stage != 3 else 2
    if odd and args.fault == "micro":
        cfg["train_micro_batch_size_per_gpu"] = 3
    if odd and args.fault == "gas":
        cfg["gradient_accumulation_steps"] = 2
    if odd and args.fault == "precision":
        cfg["bf16"] = {"enabled": True}
    if args.nvme:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": args.nvme}
    return cfg


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank-at-fault", type=int, default=1)
    p.add_argument("--comms-timeout", type=float, default=0.0)
    p.add_argument("--tag-validation", default="Warn")
    p.add_argument("--save-dir", default="")
    p.add_argument("--nvme", default="")
    p.add_argument("--local_rank", type=int, default=0)  # zero run's shim passes it
    args = p.parse_args()
    torch.set_num_threads(1)
    import zero_core
    from zero_core.testing.models import TinyLM, token_batch

    rank = int(os.environ.get("RANK", "0"))
    odd = rank == args.rank_at_fault
    torch.manual_seed(0)
    model = TinyLM(16, 8, 16 if (odd and args.fault == "model") else 12, mlp="one_layer", norm=False)
    engine, *_ = zero_core.initialize(model=model, config=_config(args, odd))
    step = 0
    while args.fault == "sigterm" or step < args.steps:
        x, y = token_batch(100 * step + rank, 2, 5, 16)
        if odd and args.fault == "stall":
            time.sleep(3600)
        engine.backward(engine(x, y))
        engine.step()
        step += 1
        if args.fault == "sigterm":
            print("TRAINING", flush=True)
    if args.save_dir and (args.fault != "save-alone" or odd):
        tag = f"other{rank}" if (odd and args.fault == "tags") else "t1"
        engine.save_checkpoint(args.save_dir, tag=tag)
        print(f"SAVED {sorted(os.listdir(args.save_dir))}", flush=True)
    engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
