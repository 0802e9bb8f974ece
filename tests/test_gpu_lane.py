"""The GPU lane: the parity suite on CUDA with NCCL (see [Note: GPU test lane]).

Stages 0-3, CPU optimizer offload, bf16/fp16 and a checkpoint save/load, each against plain
single-process PyTorch trained on the same global batches on the same device (fp32: 1e-5
relative; bf16/fp16: the losses within a few percent of the fp32 reference, all finite). World
size 1 on one GPU, 2 where there are more; every case of a world size runs in one launch.
Skipped with a "needs CUDA: ..." reason where CUDA is absent. ``ZERO_GPU_LANE_FORCE_CPU=1``
runs the same suite on CPU with gloo (for working on the lane itself on a CPU-only machine).
``ZERO_GPU_LANE_TIMINGS=path`` makes rank 0 write each case's median step time there (JSON),
which ``tools/gpu_check.sh`` turns into the lane's results file.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.gpu_lane import choose_backend, lane_world_size, needs_cuda

FORCE_CPU = os.environ.get("ZERO_GPU_LANE_FORCE_CPU", "") == "1"
pytestmark = [pytest.mark.gpu] if FORCE_CPU else needs_cuda(1)
WORLD = 2 if FORCE_CPU else lane_world_size()
STEPS, MICRO, SEQ, VOCAB = 5, 2, 8, 32

CASES = [
    {"name": "stage0_fp32", "zero": {"stage": 0}},
    {"name": "stage1_fp32", "zero": {"stage": 1}},
    {"name": "stage2_fp32", "zero": {"stage": 2, "reduce_bucket_size": 500}},
    {"name": "stage3_fp32", "zero": {"stage": 3, "stage3_param_persistence_threshold": 0}},
    {"name": "stage2_offload_fp32", "zero": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    {
        "name": "stage3_offload_fp32",
        "zero": {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}},
    },
    {"name": "stage2_bf16", "zero": {"stage": 2}, "bf16": {"enabled": True}},
    {
        "name": "stage3_fp16",
        "zero": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "fp16": {"enabled": True, "initial_scale_power": 8},
    },
]


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    from zero_core.testing.models import token_batch

    return token_batch(1000 + step, world * MICRO, SEQ, VOCAB)


def _model() -> torch.nn.Module:
    from zero_core.testing.models import TinyLM

    torch.manual_seed(0)
    return TinyLM(VOCAB, 16, 23, attention=True)


def _config(case: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": case["zero"],
    }
    for key in ("bf16", "fp16"):
        if key in case:
            cfg[key] = case[key]
    return cfg


def _reference(device: torch.device, world: int) -> list[float]:
    from zero_core.testing.parity import train_reference

    model = _model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    batch = [tuple(t.to(device) for t in _batch(s, world)) for s in range(STEPS)]
    return train_reference(model, opt, lambda s: batch[s], STEPS, clip=1.0)[0]


def _timed_train(engine, world: int) -> tuple[list[float], float]:
    from zero_core.accelerator import get_accelerator
    from zero_core.testing.parity import train_engine

    times: list[float] = []
    last = [time.perf_counter()]

    def tick(_step: int) -> None:
        get_accelerator().synchronize()
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    losses = train_engine(engine, lambda s: _batch(s, world), STEPS, micro=MICRO, after_step=tick)
    return losses, statistics.median(times[1:])  # the first step compiles and warms up


def _run_case(case: dict, ref: list[float], world: int) -> dict:
    import zero_core

    engine, *_ = zero_core.initialize(model=_model(), config=_config(case))
    assert engine.device.type == ("cpu" if FORCE_CPU else "cuda"), engine.device
    losses, step_s = _timed_train(engine, world)
    engine.destroy()
    return {"losses": losses, "ref": ref, "step_s": step_s}


def _checkpoint_case(tmp: str, world: int) -> dict:
    """Train 2 steps, save, train 3 more; a fresh engine loads the checkpoint and trains the
    same 3 steps: the losses agree (stage 3 with CPU offload, the most state to restore)."""
    import zero_core
    from zero_core.testing.parity import train_engine

    case = CASES[5]
    batch = lambda s: _batch(s, world)  # noqa: E731
    engine, *_ = zero_core.initialize(model=_model(), config=_config(case))
    train_engine(engine, batch, range(2), micro=MICRO)
    engine.save_checkpoint(tmp, tag="lane")
    after_save = train_engine(engine, batch, range(2, STEPS), micro=MICRO)
    engine.destroy()
    resumed, *_ = zero_core.initialize(model=_model(), config=_config(case))
    resumed.load_checkpoint(tmp, tag="lane")
    after_load = train_engine(resumed, batch, range(2, STEPS), micro=MICRO)
    resumed.destroy()
    return {"after_save": after_save, "after_load": after_load}


def _lane(tmp: str, timings: str | None) -> dict:
    from zero_core import comm
    from zero_core.accelerator import get_accelerator

    world = comm.get_world_size()
    device = get_accelerator().device(get_accelerator().current_device())
    assert comm.get_rank() == get_accelerator().current_device() or FORCE_CPU  # one GPU per rank
    ref = _reference(device, world)
    out = {c["name"]: _run_case(c, ref, world) for c in CASES}
    out["checkpoint"] = _checkpoint_case(tmp, world)
    if timings and comm.get_rank() == 0:
        rows = {name: r["step_s"] for name, r in out.items() if "step_s" in r}
        name = "cpu" if FORCE_CPU else torch.cuda.get_device_name(device)
        with open(timings, "w") as f:
            json.dump({"device": name, "world_size": world, "steps": STEPS, "median_step_s": rows}, f)
    return out


def test_gpu_lane_parity(tmp_path):
    backend = "gloo" if FORCE_CPU else choose_backend(WORLD)
    assert FORCE_CPU or backend == "nccl"
    timings = os.environ.get("ZERO_GPU_LANE_TIMINGS")
    results = run_multirank(_lane, WORLD, args=(str(tmp_path), timings), backend=backend, timeout=900)
    for rank, out in enumerate(results):
        for case in CASES:
            r = out[case["name"]]
            where = f"rank {rank}, {case['name']}"
            assert all(torch.isfinite(torch.tensor(r["losses"]))), where
            low = "bf16" in case or "fp16" in case
            rtol = 5e-2 if low else 1e-5
            assert r["losses"] == pytest.approx(r["ref"], rel=rtol, abs=1e-6), where
        ck = out["checkpoint"]
        assert ck["after_load"] == pytest.approx(ck["after_save"], rel=1e-6), f"rank {rank}, checkpoint"
