"""A tiny training script for the autotuning tests (launched by ``zero run --autotuning``).

It trains a small MLP with ``zero_core.initialize`` for ``--steps`` steps. For the failure
tests it misbehaves on request, by ZeRO stage of the config it was given:
``JOB_RAISE_STAGE`` raises, ``JOB_HANG_STAGE`` sleeps forever, and ``JOB_HOLD_STAGE`` sleeps
while the file ``JOB_HOLD_FILE`` exists, after writing its process id to ``JOB_HOLD_FILE.pid``
(so a test can interrupt a search in the middle of that experiment, then let a rerun pass).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--zero_config", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    with open(args.zero_config) as f:
        config = json.load(f)
    stage = int(config["zero_optimization"]["stage"])
    # misbehave before importing torch: quick even on a loaded machine
    if os.environ.get("JOB_RAISE_STAGE") == str(stage):
        raise ValueError(f"deliberate failure at stage {stage}")
    while os.environ.get("JOB_HANG_STAGE") == str(stage):
        time.sleep(1)
    hold = os.environ.get("JOB_HOLD_FILE")
    if os.environ.get("JOB_HOLD_STAGE") == str(stage) and hold and os.path.exists(hold):
        with open(hold + ".pid", "w") as f:
            f.write(str(os.getpid()))
        while os.path.exists(hold):
            time.sleep(0.5)
    import torch
    from zero_core.engine.initialize import initialize

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, _, _, _ = initialize(model=model, config=config)
    mbs = engine.train_micro_batch_size_per_gpu()
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        x = torch.randn(mbs, 16)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()


if __name__ == "__main__":
    main()
