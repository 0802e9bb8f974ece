"""The pattern of DeepSpeedExamples' ``training/pipeline_parallelism/train.py``, on zero.

    zero run --nproc 2 examples/deepspeed_patterns/pipeline_train.py \\
        --zero_config examples/deepspeed_patterns/pipeline_config.json --steps 20

A vision model is flattened into a list of layers (its ``features``, a flatten function, its
``classifier``), a ``zero.pipe.PipelineModule`` splits them over ``--pipeline-parallel-size``
stages, ``zero.initialize(args=..., model=..., training_data=...)`` builds the pipeline engine
from the config file given with ``--zero_config`` (or DeepSpeed's ``--deepspeed_config``), and
each ``engine.train_batch()`` (no argument) runs ``gradient_accumulation_steps`` micro-batches
drawn from that ``training_data``, as in DeepSpeed. The engine prints DeepSpeed's progress line
every ``steps_per_print`` batches. The data is a synthetic CIFAR-shaped set (no download).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zero  # noqa: E402
from synthetic_images import CLASSES, SyntheticImages  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="pipeline-parallel training with zero")
    p.add_argument("--steps", type=int, default=100, help="batches to train")
    p.add_argument("--pipeline-parallel-size", "-p", type=int, default=2, help="pipeline stages")
    p.add_argument("--partition-method", default="parameters", help="how layers are split over stages")
    p.add_argument("--seed", type=int, default=1138)
    p.add_argument("--samples", type=int, default=2048, help="size of the synthetic training set")
    zero.add_config_arguments(p)
    return p.parse_args(argv)


class SmallAlexNet(nn.Module):
    """An AlexNet-shaped network for 32x32 images: ``features``, ``avgpool``, ``classifier``."""

    def __init__(self, num_classes: int = CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Linear(32 * 2 * 2, 64),
            nn.ReLU(inplace=True),
            nn.Linear(64, num_classes),
        )


def join_layers(model: SmallAlexNet) -> list:
    """The model as one list of layers, as DeepSpeedExamples' script flattens torchvision's AlexNet."""
    return [*model.features, model.avgpool, lambda x: torch.flatten(x, 1), *model.classifier]


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    zero.init_distributed()
    net = zero.pipe.PipelineModule(
        layers=join_layers(SmallAlexNet()),
        loss_fn=nn.CrossEntropyLoss(),
        num_stages=args.pipeline_parallel_size,
        partition_method=args.partition_method,
        activation_checkpoint_interval=0,
    )
    engine, _, _, _ = zero.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=SyntheticImages(args.samples),
    )
    losses = [engine.train_batch().item() for _ in range(args.steps)]
    if zero.comm.get_rank() == 0:
        print(f"done: {args.steps} batches; loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return losses


if __name__ == "__main__":
    main()
