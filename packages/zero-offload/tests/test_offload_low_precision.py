"""bf16 and fp16 training with optimizer (and parameter) offload.

* bf16: the CPU step updates the fp32 masters and writes the bf16 copy in the same pass
  (CPUAdam's ``low_precision_out``); that copy is what goes back to the module. Compared with
  a bf16 run of the same stage *without* offload (torch's Adam on the device-side fp32
  masters, then a cast): the fp32 masters agree to fp32 rounding, so losses agree within
  ``rtol=2e-3`` and bf16 weights within one bf16 ulp (``rtol=8e-3``) after 10 steps, the
  tolerance covering a rare rounding-boundary flip of the bf16 cast feeding back.
* fp16: a first loss scale of 2^24 overflows; the offloaded run skips exactly the same steps as
  the non-offloaded one and then trains the same trajectory.
"""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.models import TinyLM, token_batch
from zero_core.testing.parity import train_engine

STEPS = 10
VOCAB = 32


def _data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(500 + step, 2 * world, 8, VOCAB)


def _train(case: dict, nvme: str) -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.zero.stage3 import GatheredParameters

    world = comm.get_world_size()
    torch.manual_seed(0)
    model = TinyLM(VOCAB, 16, 24, mlp="one_layer", norm=False)
    zc: dict = {"stage": case["stage"], "sub_group_size": 500}
    if case.get("opt"):
        zc["offload_optimizer"] = {"device": case["opt"]}
        if case["opt"] == "nvme":
            zc["offload_optimizer"].update(nvme_path=nvme, pipeline_read=True, pipeline_write=True)
    if case.get("param"):
        zc["offload_param"] = {"device": case["param"]}
        if case["param"] == "nvme":
            zc["offload_param"].update(nvme_path=nvme, buffer_count=3, buffer_size=1024)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "zero_optimization": zc,
    }
    if case["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    else:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 1000, "hysteresis": 1}
    engine, *_ = zero_core.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=3e-3), config=cfg
    )
    losses = train_engine(engine, lambda step: _data(step, world), STEPS, micro=2)
    params = list(model.parameters())
    if case["stage"] == 3:
        with GatheredParameters(params):
            weights = [p.detach().float().clone() for p in params]
    else:
        weights = [p.detach().float().clone() for p in params]
    out = {
        "losses": losses,
        "weights": weights,
        "dtype": str(params[0].dtype),
        "skipped": engine.skipped_steps,
        "scale": engine.loss_scaler.loss_scale,
    }
    engine.destroy()
    return out


def _run(cases: list[dict], nvme: str) -> list[dict]:
    return [_train(c, nvme) for c in cases]


# (offloaded case, its non-offloaded twin)
PAIRS = [
    (dict(stage=1, dtype="bf16", opt="cpu"), dict(stage=1, dtype="bf16")),
    (dict(stage=2, dtype="bf16", opt="nvme"), dict(stage=2, dtype="bf16")),
    (dict(stage=3, dtype="bf16", opt="cpu"), dict(stage=3, dtype="bf16")),
    (dict(stage=3, dtype="bf16", opt="nvme", param="nvme"), dict(stage=3, dtype="bf16")),
    (dict(stage=2, dtype="fp16", opt="cpu"), dict(stage=2, dtype="fp16")),
    (dict(stage=3, dtype="fp16", opt="nvme", param="cpu"), dict(stage=3, dtype="fp16")),
]


@pytest.mark.parametrize("world", [1, 2])
def test_offload_low_precision_matches_non_offloaded_run(world: int, tmp_path) -> None:
    cases = [c for pair in PAIRS for c in pair]
    (results, *_) = run_multirank(_run, world, args=(cases, str(tmp_path)), timeout=240)
    for k, (off_case, _) in enumerate(PAIRS):
        off, ref = results[2 * k], results[2 * k + 1]
        assert (
            off["dtype"]
            == ref["dtype"]
            == f"torch.{'bfloat16' if off_case['dtype'] == 'bf16' else 'float16'}"
        )
        torch.testing.assert_close(
            torch.tensor(off["losses"]), torch.tensor(ref["losses"]), rtol=2e-3, atol=1e-4, msg=f"{off_case}"
        )
        for a, b in zip(off["weights"], ref["weights"]):
            torch.testing.assert_close(a, b, rtol=8e-3, atol=1e-3, msg=f"{off_case}")
        if off_case["dtype"] == "fp16":
            # 2^24 overflows: both runs skip the same first steps, then train; same final scale
            assert 0 < off["skipped"] == ref["skipped"] < STEPS, (off_case, off["skipped"], ref["skipped"])
            assert off["scale"] == ref["scale"], off_case
