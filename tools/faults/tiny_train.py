"""A tiny training script for the fault-injection cases of ``run_faults.py`` (launch it with
``zero run --nproc N`` or torchrun): a few steps of a small token model at a chosen ZeRO stage
(or a two-stage pipeline), with an optional injected fault.

Faults (``--fault``): ``none``; ``stall`` (rank ``--rank-at-fault`` sleeps before its first
backward, so its peers wait in a collective); ``stage`` / ``micro`` / ``gas`` / ``precision`` /
``model`` (that rank's setup differs from its peers'); ``save-alone`` (only that rank calls
save_checkpoint); ``tags`` (that rank passes another tag; ``--tag-validation`` picks the mode);
``sigterm`` (the script prints ``TRAINING`` each step and trains until killed; NVMe offload of
the optimizer under ``--nvme``). A failing rank (issue 37): ``raise``, ``exit`` (``sys.exit(1)``),
``os_exit`` (``os._exit(1)``), ``sigkill``, ``sigterm-self``: that rank fails at step
``--fault-step`` in ``--phase`` forward (a forward pre-hook), backward (a gradient hook) or
step (an optimizer step pre-hook), printing ``FAULT <unix time>`` first. ``--pipeline`` trains
a two-stage ``PipelineModule`` instead (data parallel over the other ranks).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

import torch

FAIL_KINDS = ("raise", "exit", "os_exit", "sigkill", "sigterm-self")
PHASES = ("forward", "backward", "step")


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
    if args.pipeline:
        cfg["gradient_accumulation_steps"] = 2
    return cfg


def fail_now(kind: str, rank: int) -> None:
    """Fail this process the ``kind`` way (see the module docstring), saying when first."""
    print(f"FAULT {time.time():.3f} rank {rank} {kind}", flush=True)
    if kind == "raise":
        raise RuntimeError(f"injected failure on rank {rank}")
    if kind == "exit":
        sys.exit(1)
    if kind == "os_exit":
        os._exit(1)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sigterm-self":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # a handler may run first; the default action ends the process
    raise ValueError(f"unknown fault kind {kind!r}")


class _Injector:
    """Arms the hooks that fail this rank at step ``step`` in ``phase``."""

    def __init__(self, kind: str, phase: str, step: int, rank: int) -> None:
        self.kind, self.phase, self.step, self.rank = kind, phase, step, rank
        self.current = -1

    def maybe(self, phase: str) -> None:
        if phase == self.phase and self.current == self.step:
            fail_now(self.kind, self.rank)

    def arm(self, engine: Any) -> None:
        engine.module.register_forward_pre_hook(lambda *_: self.maybe("forward"))
        params = [p for p in engine.module.parameters() if p.requires_grad]
        if params:
            params[-1].register_hook(lambda g: (self.maybe("backward"), g)[1])
        strategy = engine.strategy  # its step is the optimizer step, offloaded or not
        inner_step = strategy.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self.maybe("step")
            return inner_step(*args, **kwargs)

        strategy.step = step


def _pipeline(args: argparse.Namespace, rank: int, injector: _Injector | None) -> int:
    import zero_core
    from zero_pipe import LayerSpec, PipelineModule

    zero_core.init_distributed()
    torch.manual_seed(0)
    layers = [LayerSpec(torch.nn.Linear, 8, 8) for _ in range(4)]
    model = PipelineModule(
        layers, num_stages=2, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform"
    )
    engine, *_ = zero_core.initialize(model=model, config=_config(args, False))
    if injector is not None:
        injector.arm(engine)
    for step in range(args.steps):
        if injector is not None:
            injector.current = step
        g = torch.Generator().manual_seed(step)
        batch = [(torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)) for _ in range(2)]
        engine.train_batch(iter(batch))
    return 0


def _save_failing(engine: Any, args: argparse.Namespace, rank: int, odd: bool) -> None:
    """Train a step more, then save tag ``t2``; the odd rank fails while writing its tensor file."""
    from zero_core.checkpoint import atomic

    x, y = __import__("zero_core.testing.models", fromlist=["token_batch"]).token_batch(999 + rank, 2, 5, 16)
    engine.backward(engine(x, y))
    engine.step()
    if odd:
        real = atomic._write_all

        def write(f: Any, view: memoryview) -> None:
            if ".safetensors.tmp." in f.name:
                fail_now(args.save_fault, rank)
            real(f, view)

        atomic._write_all = write
    engine.save_checkpoint(args.save_dir, tag="t2")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--fault", default="none")
    p.add_argument("--phase", choices=PHASES, default="backward")
    p.add_argument("--fault-step", type=int, default=1)
    p.add_argument("--rank-at-fault", type=int, default=1)
    p.add_argument("--comms-timeout", type=float, default=0.0)
    p.add_argument("--tag-validation", default="Warn")
    p.add_argument("--save-dir", default="")
    p.add_argument("--nvme", default="")
    p.add_argument("--pipeline", action="store_true")
    p.add_argument("--save-fault", choices=("", *FAIL_KINDS), default="")
    p.add_argument("--init-timeout", type=float, default=0.0)
    p.add_argument("--local_rank", type=int, default=0)  # zero run's shim passes it
    args = p.parse_args()
    torch.set_num_threads(1)
    import zero_core
    from zero_core.distributed.world_info import discover_world
    from zero_core.testing.models import TinyLM, token_batch

    rank = discover_world().rank  # torchrun's RANK, or MPI's and Slurm's variables
    odd = rank == args.rank_at_fault
    if args.init_timeout:
        from datetime import timedelta

        zero_core.init_distributed(timeout=timedelta(seconds=args.init_timeout))
    injector = (
        _Injector(args.fault, args.phase, args.fault_step, rank) if odd and args.fault in FAIL_KINDS else None
    )
    if args.pipeline:
        return _pipeline(args, rank, injector)
    torch.manual_seed(0)
    model = TinyLM(16, 8, 16 if (odd and args.fault == "model") else 12, mlp="one_layer", norm=False)
    engine, *_ = zero_core.initialize(model=model, config=_config(args, odd))
    if injector is not None:
        injector.arm(engine)
    step = 0
    while args.fault == "sigterm" or step < args.steps:
        if injector is not None:
            injector.current = step
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
    if args.save_fault:
        _save_failing(engine, args, rank, odd)
    engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
