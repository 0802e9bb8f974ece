"""Expert parallelism: ep_size 2 and 4 give the outputs and gradients of ep_size 1.

Every rank builds the reference (ep_size=1, all experts) and the expert-parallel layer with the
same global weights, runs the reference on every rank's tokens, and compares its own output and,
after ``reduce_moe_gradients``, every gradient with the reference's averaged over ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from zero_core.comm import all_to_all as comm_all_to_all
from zero_core.testing import run_multirank
from zero_moe import MoE, groups, reduce_moe_gradients

M, H, E, TOKENS = 8, 12, 8, 24

CONFIGS = [
    # (k, extra MoE kwargs); capacity_factor=1 drops tokens, so dropping is compared too
    (1, {"capacity_factor": 1.0}),
    (2, {"capacity_factor": 1.0}),
    (3, {"capacity_factor": 1.0, "use_residual": True}),
    (2, {"drop_tokens": False}),
    (1, {"drop_tokens": False, "dropless_impl": "padded"}),
]


def _make_expert() -> nn.Module:
    return nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M))


def _build(ep_size: int, k: int, kwargs: dict) -> MoE:
    torch.manual_seed(0)  # same gate / residual weights on every rank and for every ep_size
    moe = MoE(
        M,
        _make_expert(),
        num_experts=E,
        ep_size=ep_size,
        k=k,
        min_capacity=0,
        use_rts=False,
        top2_2nd_expert_sampling=False,
        **kwargs,
    )
    g = torch.Generator().manual_seed(1)
    global_states = [
        {name: torch.randn(p.shape, generator=g) * 0.5 for name, p in _make_expert().named_parameters()}
        for _ in range(E)
    ]
    offset = moe.global_expert_offset
    for i, expert in enumerate(moe.zero_moe.experts.zero_experts):
        expert.load_state_dict(global_states[offset + i])
    return moe


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(TOKENS, M, generator=g), torch.randn(TOKENS, M, generator=g)


def _loss(moe: MoE, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, l_aux, _ = moe(x)
    return out, (out * target).sum() + 0.1 * l_aux


def _check_parity(ep_size: int) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    checked = 0
    for k, kwargs in CONFIGS:
        ref = _build(1, k, kwargs)
        moe = _build(ep_size, k, kwargs)
        ref_out = None
        for r in range(world):  # reference: every rank's tokens, one process, gradients summed
            x, t = _inputs(r)
            out, loss = _loss(ref, x, t)
            loss.backward()
            if r == rank:
                ref_out = out.detach()
        x, t = _inputs(rank)
        out, loss = _loss(moe, x, t)
        loss.backward()
        reduce_moe_gradients(moe)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)

        ref_params = dict(ref.named_parameters())
        offset = moe.global_expert_offset
        for name, p in moe.named_parameters():
            if ".zero_experts." in name:
                head, tail = name.split(".zero_experts.")
                local, rest = tail.split(".", 1)
                ref_name = f"{head}.zero_experts.{offset + int(local)}.{rest}"
            else:
                ref_name = name
            torch.testing.assert_close(p.grad, ref_params[ref_name].grad / world, rtol=1e-5, atol=1e-6)
            checked += 1
    return checked


def _ep_worker(ep_sizes: list[int], force_fallback: bool) -> list[int]:
    if force_fallback:
        comm_all_to_all.NO_ALL_TO_ALL.add(str(dist.get_backend()))
    return [_check_parity(ep) for ep in ep_sizes]


def test_single_rank_world():
    results = run_multirank(_ep_worker, 1, args=([1], False), timeout=60)
    assert results[0][0] > 0


def test_ep2_matches_ep1_on_two_ranks():
    results = run_multirank(_ep_worker, 2, args=([2, 1], False), timeout=120)
    assert all(n > 0 for per_rank in results for n in per_rank)


def test_ep4_and_ep2_match_ep1_on_four_ranks():
    results = run_multirank(_ep_worker, 4, args=([4, 2], False), timeout=180)
    assert all(n > 0 for per_rank in results for n in per_rank)


def test_point_to_point_all_to_all_fallback():
    results = run_multirank(_ep_worker, 2, args=([2], True), timeout=120)
    assert all(n > 0 for per_rank in results for n in per_rank)


def _logged_worker(force_fallback: bool) -> dict:
    from zero_core.comm import comms_logger

    if force_fallback:
        comm_all_to_all.NO_ALL_TO_ALL.add(str(dist.get_backend()))
    comms_logger.configure({"enabled": True})
    comms_logger.reset()
    try:
        _check_parity(2)
        return {op: comms_logger.count_for(op) for op in ("all_to_all_single", "batch_isend_irecv")}
    finally:
        comms_logger.disable()
        comms_logger.reset()


def test_expert_exchange_is_seen_by_the_comms_logger():
    """The dispatch goes through zero_core.comm: the comms logger counts it, on the direct path
    and on the point-to-point fallback (See [Note: all-to-all fallback])."""
    direct = run_multirank(_logged_worker, 2, args=(False,), timeout=120)
    assert all(r["all_to_all_single"] > 0 and r["batch_isend_irecv"] == 0 for r in direct)
    fallback = run_multirank(_logged_worker, 2, args=(True,), timeout=120)
    assert all(r["all_to_all_single"] == 0 and r["batch_isend_irecv"] > 0 for r in fallback)


def _groups_worker() -> dict:
    name = groups.create_expert_and_data_parallel(2)
    ep = groups.get_expert_parallel_group(name)
    edp = groups.get_expert_data_parallel_group(name)
    return {
        "name": name,
        "ep_ranks": dist.get_process_group_ranks(ep),
        "edp_ranks": dist.get_process_group_ranks(edp),
        "ep_rank": groups.get_expert_parallel_rank(name),
        "edp_size": groups.get_expert_data_parallel_world_size(name),
        "again": groups.create_expert_and_data_parallel(2),
    }


def test_expert_groups_layout():
    results = run_multirank(_groups_worker, 4, timeout=60)
    for rank, res in enumerate(results):
        assert res["name"] == res["again"] == "ep_size_2"
        assert res["ep_ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert res["edp_ranks"] == ([0, 2] if rank % 2 == 0 else [1, 3])
        assert res["ep_rank"] == rank % 2 and res["edp_size"] == 2


def _bad_ep_worker() -> str:
    try:
        groups.create_expert_and_data_parallel(3)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ep_size_must_divide_world():
    assert all("must divide the world size 2" in msg for msg in run_multirank(_bad_ep_worker, 2, timeout=60))
