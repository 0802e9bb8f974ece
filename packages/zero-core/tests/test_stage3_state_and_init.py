"""Stage-3 safe_get/safe_set helpers and zero.Init(module=..., remote_device="cpu") shards (one 4-rank launch).

Construction-time peak memory under zero.Init is asserted in test_stage3_init_memory.py, in fresh
(non-forked) processes.
"""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank

WORLD = 4


def _rank() -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_grad,
        safe_get_local_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    rank, out = comm.get_rank(), {}
    # -- partitioning a pre-built module: shards are new CPU storage, never views of the original --
    torch.manual_seed(rank)  # ranks differ: the partition must take rank 0's values
    pre = torch.nn.Linear(10, 7)
    originals = [p.data for p in pre.parameters()]
    rank0_weight = originals[0].clone()
    comm.broadcast(rank0_weight, src=0)
    zero_core.Init(module=pre, remote_device="cpu")
    shards = [p.zero_shard for p in pre.parameters()]
    out["shard_storage_bytes"] = [s.untyped_storage().nbytes() for s in shards]
    out["shard_devices"] = [str(s.device) for s in shards]
    orig_ptrs = {o.untyped_storage().data_ptr() for o in originals}
    out["aliases_original"] = any(s.untyped_storage().data_ptr() in orig_ptrs for s in shards)
    before = shards[0].clone()
    originals[0].add_(1.0)  # writing the constructed tensor must not reach the shard
    out["shard_unchanged"] = torch.equal(shards[0], before)
    out["data_numel"] = [p.data.numel() for p in pre.parameters()]
    with zero_core.GatheredParameters(list(pre.parameters())):
        out["pre_weight_is_rank0"] = torch.equal(pre.weight.detach(), rank0_weight)
    del pre, originals, shards
    # -- safe_* helpers -----------------------------------------------------------------
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,  # the config default clips at 1.0 (as DeepSpeed does)
        "zero_optimization": {"stage": 3, "param_persistence_threshold": 0},
    }
    engine, *_ = zero_core.initialize(
        model=model, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2), config=cfg
    )
    x = torch.randn(WORLD, 2, 6, generator=torch.Generator().manual_seed(1))
    engine.backward(engine(x[rank]).pow(2).sum())
    w = model[0].weight
    out["grad_full"] = safe_get_full_grad(w)
    out["grad_local"] = safe_get_local_grad(w)
    engine.step()
    out["param_full"] = safe_get_full_fp32_param(w)
    out["param_local"] = safe_get_local_fp32_param(w)
    out["exp_avg_full"] = safe_get_full_optimizer_state(w, "exp_avg")
    out["exp_avg_local"] = safe_get_local_optimizer_state(w, "exp_avg")
    safe_set_full_fp32_param(w, torch.full((5, 6), 3.0))
    safe_set_full_optimizer_state(w, torch.full((5, 6), 0.5), "exp_avg")
    b = model[2].bias  # 3 elements on 4 ranks: shard of 1, ranks 3 holds only padding
    safe_set_local_fp32_param(b, torch.full((1,), float(rank + 1)))
    safe_set_local_optimizer_state(b, torch.full((1,), float(rank)), "exp_avg_sq")
    out["after_set"] = safe_get_full_fp32_param(w)
    out["exp_avg_after"] = safe_get_full_optimizer_state(w, "exp_avg")
    out["bias_after"] = safe_get_full_fp32_param(b)
    out["bias_sq_after"] = safe_get_full_optimizer_state(b, "exp_avg_sq")
    with zero_core.GatheredParameters([w]):
        out["module_w"] = w.detach().clone()
    try:
        safe_set_local_fp32_param(b, torch.zeros(2))
    except ValueError as exc:
        out["bad_local"] = str(exc)
    # a parameter no stage partitions (stage 0, frozen): its local part is the whole parameter
    out["unowned_local"] = safe_get_local_fp32_param(
        torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    )
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_multirank(_rank, WORLD, timeout=150)


def test_init_module_remote_device_cpu_owns_its_shards(results: list[dict]) -> None:
    for r in results:
        # weight 70 -> 18 per rank, bias 7 -> 2 per rank (padded), fp32; each in its own storage
        assert r["shard_storage_bytes"] == [18 * 4, 2 * 4]
        assert r["shard_devices"] == ["cpu", "cpu"]
        assert not r["aliases_original"] and r["shard_unchanged"]
        assert r["data_numel"] == [0, 0]  # released: the module keeps no full parameter
        assert r["pre_weight_is_rank0"]


def test_safe_helpers_full_and_local(results: list[dict]) -> None:
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    x = torch.randn(WORLD, 2, 6, generator=torch.Generator().manual_seed(1))
    for r in range(WORLD):
        (ref(x[r]).pow(2).sum() / WORLD).backward()
    grad = ref[0].weight.grad.clone()
    opt.step()
    exp_avg = opt.state[ref[0].weight]["exp_avg"]
    shard = 30 // WORLD + (30 % WORLD > 0)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["grad_full"], grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(r["param_full"], ref[0].weight.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(r["exp_avg_full"], exp_avg, rtol=1e-5, atol=1e-7)
        lo, hi = rank * shard, min((rank + 1) * shard, 30)
        torch.testing.assert_close(r["grad_local"][: hi - lo], grad.reshape(-1)[lo:hi], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(r["param_local"][: hi - lo], ref[0].weight.detach().reshape(-1)[lo:hi])
        torch.testing.assert_close(r["exp_avg_local"][: hi - lo], exp_avg.reshape(-1)[lo:hi])
        assert torch.equal(r["after_set"], torch.full((5, 6), 3.0))
        assert torch.equal(r["module_w"], torch.full((5, 6), 3.0))  # the module sees the new value
        assert torch.equal(r["exp_avg_after"], torch.full((5, 6), 0.5))
        assert torch.equal(r["bias_after"], torch.tensor([1.0, 2.0, 3.0]))
        assert torch.equal(r["bias_sq_after"], torch.tensor([0.0, 1.0, 2.0]))
        assert "local partition" in r["bad_local"]
        assert torch.equal(r["unowned_local"], torch.tensor([1.0, 2.0, 3.0, 4.0]))
