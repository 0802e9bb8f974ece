"""``data_types.grad_accum_dtype``: gradients summed over the micro-steps in the named dtype.

8 micro-steps of a bf16 model with ``"fp32"`` give, at every ZeRO stage, exactly the fp32 sum of
the same bf16 micro-step gradients (as reduced by that stage: stages 0-1 reduce the sums once,
stages 2-3 reduce every micro-step and sum the results), and differ from the default bf16
accumulation, which itself equals the bf16 running sum. With fp16, micro-step gradients whose
sum overflows fp16 skip the step with fp16 accumulation and train with fp32 accumulation.
See [Note: gradient accumulation dtype] in zero_core/engine/grad_buckets.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank

GAS, MICRO, DIM = 8, 4, 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 4))


def _x(step: int, rank: int) -> torch.Tensor:
    return torch.randn(MICRO, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def _micro_grads(rank: int) -> list[list[torch.Tensor]]:
    """Plain PyTorch: the bf16 gradients of each micro-step of ``rank`` (loss / GAS, as the engine)."""
    model = _model().bfloat16()
    out = []
    for k in range(GAS):
        model.zero_grad(set_to_none=True)
        (model(_x(k, rank).bfloat16()).float().pow(2).mean() / GAS).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def _references(world: int, stage: int, comm_fp32: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The fp32-accumulated gradient each stage should reach, and rank 0's bf16 running sum."""
    grads = [_micro_grads(r) for r in range(world)]  # [rank][micro-step][parameter]
    n = len(grads[0][0])
    if stage <= 1:  # the per-rank fp32 sums are reduced once, at the boundary
        sums = [[_fp32_sum([g[k][i] for k in range(GAS)]) for i in range(n)] for g in grads]
        fp32 = [sum((s[i] for s in sums[1:]), sums[0][i].clone()) / world for i in range(n)]
    else:  # every micro-step is reduced, in bf16 or fp32, and the results are summed in fp32
        mean = _mean32 if comm_fp32 else _bf16_mean
        fp32 = [_fp32_sum([mean([g[k][i] for g in grads]) for k in range(GAS)]) for i in range(n)]
    bf16 = [_bf16_sum([grads[0][k][i] for k in range(GAS)]) for i in range(n)]
    return fp32, bf16


def _fp32_sum(ts: list[torch.Tensor]) -> torch.Tensor:
    acc = ts[0].float().clone()
    for t in ts[1:]:
        acc.add_(t)
    return acc


def _bf16_sum(ts: list[torch.Tensor]) -> torch.Tensor:
    acc = ts[0].clone()
    for t in ts[1:]:
        acc.add_(t)
    return acc.float()


def _bf16_mean(ts: list[torch.Tensor]) -> torch.Tensor:
    acc = ts[0] / len(ts)
    for t in ts[1:]:
        acc = acc + t / len(ts)
    return acc


def _mean32(ts: list[torch.Tensor]) -> torch.Tensor:
    acc = ts[0].float() / len(ts)
    for t in ts[1:]:
        acc = acc + t.float() / len(ts)
    return acc


def _engine_grads(stage: int, accum: str | None, comm_fp32: bool) -> list[torch.Tensor]:
    import zero_core
    from zero_core import comm
    from zero_core.zero.debug_access import safe_get_full_grad

    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 10**6,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100},
    }
    if accum is not None:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    if comm_fp32:
        cfg["communication_data_type"] = "fp32"
    model = _model()
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    rank = comm.get_rank()
    for k in range(GAS):
        engine.backward(engine(_x(k, rank).bfloat16()).float().pow(2).mean())
        if k < GAS - 1:
            engine.step()
    grads = [safe_get_full_grad(p) for p in model.parameters()]
    engine.step()
    engine.destroy()
    return grads


def _run(stages: tuple[int, ...], comm_fp32: bool) -> list:
    return [
        (
            _engine_grads(s, "fp32", comm_fp32),
            _engine_grads(s, None, comm_fp32),
            _engine_grads(s, "bf16", comm_fp32),
        )
        for s in stages
    ]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp32_accumulation_is_the_exact_fp32_sum_of_the_bf16_micro_gradients(world: int) -> None:
    # world 4 (stages 1-3, where partitions matter) reduces in fp32 and compares to rounding:
    # gloo's 4-way sum has its own order; worlds 1 and 2 are exact
    stages, comm_fp32 = ((0, 1, 2, 3), False) if world < 4 else ((1, 2, 3), True)
    results = run_multirank(_run, world, args=(stages, comm_fp32), timeout=240)
    for stage, (fp32, default, bf16) in zip(stages, results[0]):
        ref32, ref16 = _references(world, stage, comm_fp32)
        for i, (a, d, b) in enumerate(zip(fp32, default, bf16)):
            where = f"stage {stage}, world {world}, parameter {i}"
            assert a.dtype == torch.float32 and torch.equal(d, b), where  # "bf16" is the default
            if world < 4:
                assert torch.equal(a, ref32[i]), f"{where}: not the fp32 sum ({(a - ref32[i]).abs().max()})"
            else:
                torch.testing.assert_close(a, ref32[i], rtol=1e-6, atol=1e-8, msg=where)
            if world == 1:
                assert torch.equal(d, ref16[i]), f"{where}: the default is not the bf16 running sum"
        assert any(not torch.equal(a, d) for a, d in zip(fp32, default)), f"stage {stage}: fp32 == bf16"
    for per_rank in results[1:]:  # every rank reads the same full gradients
        for mine, theirs in zip(per_rank, results[0]):
            assert all(torch.equal(a, b) for a, b in zip(mine[0], theirs[0]))


def _fp16_skips(stages: tuple[int, ...]) -> list[tuple[int, int]]:
    """Skipped steps with fp16 and fp32 accumulation of micro-gradients summing past fp16's range."""
    import zero_core

    out = []
    for stage in stages:
        skipped = []
        for accum in ("fp16", "fp32"):
            torch.manual_seed(0)
            model = nn.Linear(DIM, 4)
            cfg = {
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_accumulation_steps": GAS,
                "steps_per_print": 10**6,
                "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
                # each micro-step's weight gradient is 2**15 / GAS * MICRO = 16384; eight sum to 131072
                "fp16": {"enabled": True, "loss_scale": 2.0**15},
                "data_types": {"grad_accum_dtype": accum},
                "zero_optimization": {"stage": stage},
            }
            engine, *_ = zero_core.initialize(model=model, config=cfg)
            for _ in range(GAS):
                engine.backward(engine(torch.ones(MICRO, DIM, dtype=torch.float16)).float().sum())
                engine.step()
            skipped.append(engine.skipped_steps)
            engine.destroy()
        out.append(tuple(skipped))
    return out


def test_fp16_gradients_summing_past_the_fp16_range_train_with_fp32_accumulation() -> None:
    stages = (0, 1, 2, 3)
    for per_rank in run_multirank(_fp16_skips, 2, args=(stages,), timeout=240):
        assert per_rank == [(1, 0)] * len(stages), per_rank


def test_grad_accum_dtype_narrower_than_training_is_an_error() -> None:
    from zero_core.config import ConfigError, load_config

    base = {"train_batch_size": 8}
    with pytest.raises(ConfigError, match='data_types.grad_accum_dtype: "fp16" with bf16 training'):
        load_config({**base, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}})
    with pytest.raises(ConfigError, match='data_types.grad_accum_dtype: "bf16" with fp32 training'):
        load_config({**base, "data_types": {"grad_accum_dtype": "bf16"}})
    load_config({**base, "fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})


def _syncs(stage: int, precision: str) -> tuple[list[int], list[int]]:
    """Host reads per micro-step and per optimizer step with fp32 accumulation (steps 2 and 3)."""
    import zero_core
    from zero_core import comm
    from zero_core.testing.host_syncs import count_host_syncs
    from zero_core.zero.stage3 import set_collective_checks

    set_collective_checks(False)  # stage 3's per-bucket agreement read is another matter (issue 33, point 3)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        precision: {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})},
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100},
    }
    engine, *_ = zero_core.initialize(model=_model(), config=cfg)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    micro, steps = [], []
    for step in range(3):
        for k in range(2):
            with count_host_syncs() as c:
                engine.backward(engine(_x(10 * step + k, comm.get_rank()).to(dtype)).float().pow(2).mean())
                if k == 0:
                    engine.step()
            with count_host_syncs() as s:
                if k == 1:
                    engine.step()
            if step > 0:
                micro.append(c.total)
                if k == 1:
                    steps.append(s.total)
    engine.destroy()
    set_collective_checks(True)
    return micro, steps


def test_fp32_accumulation_adds_no_host_sync() -> None:
    cases = [(0, "bf16"), (1, "fp16"), (2, "bf16"), (3, "bf16")]
    for per_rank in run_multirank(lambda: [_syncs(*c) for c in cases], 2, timeout=240):
        for case, (micro, steps) in zip(cases, per_rank):
            assert micro == [0] * len(micro) and max(steps) <= 1, (case, micro, steps)
