#!/usr/bin/env python
"""Write the DeepSpeed checkpoint fixtures that ``zero.checkpoint.from_deepspeed`` is tested on.

Run it with a Python that has DeepSpeed (0.19.8 wrote the committed fixtures), on CPU::

    DS_ACCELERATOR=cpu /path/to/deepspeed-venv/bin/python tools/make_deepspeed_fixtures.py \
        [--out packages/zero-core/tests/fixtures/deepspeed] [--only NAME ...]

For every variant below (ZeRO stages 0-3; fp32, bf16 and fp16; 1 or 2 ranks over gloo) it
launches the ranks as processes twice:

1. ``train``: the fixture model (``fixture_model.py`` beside the fixtures, shared with the
   tests) trains ``STEPS_BEFORE_SAVE`` steps and DeepSpeed saves a checkpoint into
   ``<out>/<variant>/`` (``latest``, ``global_step3/``...);
2. ``resume``: a fresh engine over a differently initialised model loads that checkpoint
   and trains ``STEPS_AFTER_LOAD`` more steps on the next batches; rank 0 records the losses
   (mean over ranks) in ``<out>/<variant>.json`` with the DeepSpeed and torch versions, the
   config, the command and the variant.

The copies of DeepSpeed's ``zero_to_fp32.py`` / ``zero_to_torch.py`` it places in each folder
are deleted (they are DeepSpeed's code, and the converter does not need them). Needs no zero
install; the tests that use the fixtures need no DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "..", "packages", "zero-core", "tests", "fixtures", "deepspeed")

# name: (ZeRO stage, precision, world size, extra config merged into the base)
VARIANTS: dict[str, tuple[int, str, int, dict]] = {
    "stage0_fp32_ws2": (0, "fp32", 2, {}),
    "stage1_fp32_ws2": (1, "fp32", 2, {}),
    "stage2_fp32_ws2": (2, "fp32", 2, {}),
    "stage3_fp32_ws2": (3, "fp32", 2, {"zero_optimization": {"stage3_param_persistence_threshold": 0}}),
    "stage2_fp32_ws1": (2, "fp32", 1, {}),
    "stage3_fp32_ws1": (3, "fp32", 1, {}),
    "stage0_bf16_ws2": (0, "bf16", 2, {}),
    "stage1_bf16_ws2": (1, "bf16", 2, {}),
    "stage2_bf16_ws2": (2, "bf16", 2, {}),
    "stage3_bf16_ws2": (3, "bf16", 2, {}),
    # bf16 weights with fp32 gradient accumulation: DeepSpeed's BF16_Optimizer (bf16_zero_* files)
    "stage1_bf16acc32_ws2": (1, "bf16", 2, {"data_types": {"grad_accum_dtype": "fp32"}}),
    # a tied pair and a frozen parameter (fixture_model.TiedFrozenModel)
    "stage2_tiedfrozen_ws2": (2, "fp32", 2, {"model": "tied_frozen"}),
    "stage3_tiedfrozen_ws2": (
        3,
        "bf16",
        2,
        {"model": "tied_frozen", "zero_optimization": {"stage3_param_persistence_threshold": 0}},
    ),
    "stage0_tiedfrozen_ws1": (0, "fp32", 1, {"model": "tied_frozen"}),
    "stage0_fp16_ws1": (0, "fp16", 1, {}),
    "stage2_fp16_ws2": (2, "fp16", 2, {}),
}


def config_for(stage: int, precision: str, world: int, extra: dict) -> dict:
    from fixture_model import GLOBAL_BATCH

    cfg: dict = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 0.02,
                "betas": [0.9, 0.98],
                "eps": 1e-8,
                "weight_decay": 0.05,
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 6},
        },
        "zero_optimization": {"stage": stage},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 8,
            # DeepSpeed's default window: no scale growth within the recorded steps. (0.19.8 unscales the
            # gradients of a growth step with the grown scale, halving them; zero uses the scale the
            # backward used, so runs differ from a growth step on: see [Note: importing a DeepSpeed checkpoint].)
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    for k, v in extra.items():
        if k == "model":
            continue
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return cfg


def _train_steps(engine, steps: range, rank: int, world: int) -> list[float]:
    import torch.distributed as dist
    from fixture_model import loss_fn, rank_batch

    losses = []
    dtype = next(engine.module.parameters()).dtype
    for step in steps:
        x, y = rank_batch(step, rank, world)
        loss = loss_fn(engine(x.to(dtype)), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean / world))
    return losses


def _allow_fp16_on_cpu() -> None:
    """DeepSpeed's CPU accelerator refuses fp16 (``is_fp16_supported()`` is False) although torch
    computes in fp16 on CPU; the fp16 fixtures lift that check so the files are what DeepSpeed's fp16
    path writes (recorded in their JSON)."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def worker(phase: str, variant: str, out: str) -> None:
    """One rank of one phase (``train`` or ``resume``); launched by :func:`launch`."""
    import deepspeed
    import torch
    from fixture_model import STEPS_AFTER_LOAD, STEPS_BEFORE_SAVE, build_model, param_groups

    stage, precision, world, extra = VARIANTS[variant]
    deepspeed.init_distributed(dist_backend="gloo")
    if precision == "fp16":
        _allow_fp16_on_cpu()
    rank = torch.distributed.get_rank()
    cfg = config_for(stage, precision, world, extra)
    model = build_model(seed=1234 if phase == "train" else 4321, kind=extra.get("model", "plain"))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    ckpt = os.path.join(out, variant)
    if phase == "train":
        losses = _train_steps(engine, range(STEPS_BEFORE_SAVE), rank, world)
        engine.save_checkpoint(ckpt)
        if rank == 0:
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):
                for where in (ckpt, os.path.join(ckpt, f"global_step{STEPS_BEFORE_SAVE}")):
                    if os.path.exists(os.path.join(where, script)):
                        os.unlink(os.path.join(where, script))
            with open(os.path.join(out, f".{variant}.train.json"), "w") as f:
                json.dump(losses, f)
        return
    engine.load_checkpoint(ckpt)
    losses = _train_steps(engine, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD), rank, world)
    if rank == 0:
        with open(os.path.join(out, f".{variant}.train.json")) as f:
            before = json.load(f)
        os.unlink(os.path.join(out, f".{variant}.train.json"))
        record = {
            "variant": variant,
            "zero_stage": stage,
            "precision": precision,
            "world_size": world,
            "tag": f"global_step{STEPS_BEFORE_SAVE}",
            "deepspeed_version": deepspeed.__version__,
            "torch_version": torch.__version__,
            "config": cfg,
            "model_kind": extra.get("model", "plain"),
            "model": "fixture_model.build_model(seed=1234, kind=model_kind), param_groups(model)",
            "data": "fixture_model.rank_batch(step, rank, world_size); loss: fixture_model.loss_fn",
            "losses_before_save": before,
            "losses_after_load": losses,
            "loss_is": "mean over ranks of each rank's fp32 loss, per optimizer step",
            "notes": "fp16 on DeepSpeed's CPU accelerator: its is_fp16_supported() check is overridden"
            if precision == "fp16"
            else "",
            "command": "DS_ACCELERATOR=cpu python tools/make_deepspeed_fixtures.py --only " + variant,
        }
        with open(os.path.join(out, f"{variant}.json"), "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(phase: str, variant: str, out: str) -> None:
    """Run ``phase`` of ``variant`` on its world size as processes; raise if a rank fails."""
    world = VARIANTS[variant][2]
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", phase, variant, "--out", out]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for rank, p in enumerate(procs):
        text, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            sys.stderr.write(text.decode(errors="replace")[-6000:])
            raise SystemExit(f"{variant} {phase}: rank {rank} exited with {p.returncode}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="variants to (re)write; default all")
    ap.add_argument("--worker", nargs=2, metavar=("PHASE", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    sys.path.insert(0, out)  # fixture_model.py
    if args.worker:
        worker(args.worker[0], args.worker[1], out)
        return
    names = args.only or sorted(VARIANTS)
    for i, name in enumerate(names):
        t0 = time.time()
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
        launch("train", name, out)
        launch("resume", name, out)
        print(f"[{i + 1}/{len(names)}] {name}: {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
