"""The engine-loop pattern of DeepSpeedExamples' ``training/cifar/cifar10_deepspeed.py``, on zero.

    zero run --nproc 2 examples/deepspeed_patterns/cifar_engine_loop.py --epochs 1
    zero run --nproc 2 examples/deepspeed_patterns/cifar_engine_loop.py --moe --ep-world-size 2

A DeepSpeed script of this shape runs after ``deepspeed`` -> ``zero``: arguments come from
``zero.add_config_arguments`` (so ``--local_rank`` from the launcher and ``--deepspeed`` are
accepted), the config is built in code from the arguments, ``zero.initialize(args=..., model=...,
model_parameters=..., training_data=..., config=...)`` returns the engine and the data loader,
and the loop is ``loss = criterion(engine(x), y); engine.backward(loss); engine.step()``.
``--moe`` replaces the last hidden layer by a Mixture-of-Experts layer (zero.moe.layer.MoE) with
its own optimizer parameter groups (``--moe-param-group``), as the DeepSpeed script does.
The data is a synthetic CIFAR-shaped set (no download).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zero  # noqa: E402
from synthetic_images import CLASSES, SyntheticImages  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="CIFAR-shaped training with the zero engine")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: full epochs)")
    p.add_argument("--log-interval", type=int, default=10, help="print the loss every N micro-batches")
    p.add_argument("--samples", type=int, default=2048, help="size of the synthetic training set")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--stage", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--moe", action="store_true", help="use a Mixture-of-Experts layer")
    p.add_argument("--ep-world-size", type=int, default=1, help="expert-parallel world size")
    p.add_argument("--num-experts", type=int, nargs="+", default=[2], help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=1, help="experts per token (1 or 2)")
    p.add_argument("--min-capacity", type=int, default=0)
    p.add_argument("--noisy-gate-policy", default=None, choices=[None, "RSample", "Jitter"])
    p.add_argument("--moe-param-group", action="store_true", help="separate optimizer groups for experts")
    zero.add_config_arguments(p)
    return p.parse_args(argv)


class Net(nn.Module):
    """LeNet-like: two convolutions, then fully connected layers (the last hidden one an MoE)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = args.moe
        if self.moe:
            self.moe_layers = nn.ModuleList(
                zero.moe.layer.MoE(
                    hidden_size=84,
                    expert=nn.Linear(84, 84),
                    num_experts=n,
                    ep_size=args.ep_world_size,
                    k=args.top_k,
                    min_capacity=args.min_capacity,
                    noisy_gate_policy=args.noisy_gate_policy,
                )
                for n in args.num_experts
            )
        self.fc3 = nn.Linear(84, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            for layer in self.moe_layers:
                x, _, _ = layer(x)
        return self.fc3(x)


def ds_config(args: argparse.Namespace) -> dict:
    return {
        "train_batch_size": 16 * max(1, int(os.environ.get("WORLD_SIZE", "1"))),
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.999], "eps": 1e-8}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 5},
        },
        "gradient_clipping": 1.0,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "initial_scale_power": 15},
        "zero_optimization": {"stage": args.stage},
    }


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    zero.init_distributed()  # the MoE layer builds its expert groups from the process group
    torch.manual_seed(0)
    net = Net(args)
    parameters: list = [p for p in net.parameters() if p.requires_grad]
    if args.moe_param_group:
        groups = {"params": parameters, "name": "parameters"}
        parameters = zero.moe.utils.split_params_into_different_moe_groups_for_optimizer(groups)
    engine, _, trainloader, _ = zero.initialize(
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=SyntheticImages(args.samples),
        config=ds_config(args),
    )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype, torch.float32)
    criterion = nn.CrossEntropyLoss()
    rank, step, first, running = zero.comm.get_rank(), 0, None, 0.0
    for epoch in range(args.epochs):
        for i, (inputs, labels) in enumerate(trainloader):
            inputs, labels = inputs.to(engine.device, dtype), labels.to(engine.device)
            loss = criterion(engine(inputs), labels)
            engine.backward(loss)
            engine.step()
            step += 1
            running += loss.item()
            if first is None:
                first = loss.item()
            if rank == 0 and i % args.log_interval == args.log_interval - 1:
                print(f"[{epoch + 1: d}, {i + 1: 5d}] loss: {running / args.log_interval: .3f}", flush=True)
                running = 0.0
            if args.max_steps and step >= args.max_steps:
                break
    correct = total = 0
    engine.eval()
    with torch.no_grad():
        for inputs, labels in trainloader:
            pred = engine(inputs.to(engine.device, dtype)).argmax(1)
            correct += int((pred.cpu() == labels).sum())
            total += len(labels)
            if total >= 256:
                break
    if rank == 0:
        print(f"done: {step} steps; first loss {first:.3f}; accuracy {100 * correct / total:.1f}% of {total}")
    return correct / total


if __name__ == "__main__":
    main()
