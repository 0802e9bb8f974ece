"""``NoOptimizerOffload``: the null optimizer offload the stage strategies hold without offload.

See [Note: optimizer offload seam]. The training trajectories without offload (the stage 1-3
parity tests) run through it; here its contract: it satisfies the protocol, owns nothing, keeps
the masters where they are, and answers the calls about a master with the master itself and the
optimizer's own state (identity), so stage code asks it without ``owns`` first.
"""

from __future__ import annotations

import torch
from zero_core.protocols.optimizer_offload import NoOptimizerOffload, OptimizerOffload, add_host_breakdown


def _optimizer() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.full((4,), 0.5)
    opt.step()
    return p, opt


def test_null_offload_satisfies_the_protocol_and_owns_nothing() -> None:
    off = NoOptimizerOffload()
    assert isinstance(off, OptimizerOffload)
    p, opt = _optimizer()
    assert off.adopt([p])[0] is p  # the masters stay where they are
    assert not off.owns(p) and not off.is_staged(p)
    assert off.owned_tensors() == [] and off.memory_breakdown() == {}
    assert off.state_dict_with_states(opt)["state"][0]["exp_avg"] is opt.state[p]["exp_avg"]
    before = p.detach().clone()
    off.begin_staging(True)
    off.stage_grad_range(p, 0, torch.zeros(4))
    off.step(opt, 2.0)  # nothing staged: the strategy's optimizer.step() is the step
    torch.testing.assert_close(p.detach(), before, rtol=0, atol=0)


def test_null_offload_answers_with_the_master_itself() -> None:
    """Identity: values, states and updated weights are the master's and the optimizer's own."""
    off = NoOptimizerOffload()
    p, opt = _optimizer()
    assert off.master_value(p).data_ptr() == p.data_ptr() and not off.master_value(p).requires_grad
    assert off.updated(p).data_ptr() == p.data_ptr()
    off.set_master(p, torch.arange(4.0).reshape(2, 2))  # any shape of the same numel
    torch.testing.assert_close(p.detach(), torch.arange(4.0), rtol=0, atol=0)
    assert off.state_of(opt, p) is opt.state[p]
    fresh = torch.nn.Parameter(torch.zeros(2))
    assert off.state_of(opt, fresh) == {}
    before = p.detach().clone()
    off.stage_grad(p, torch.ones(4))  # the gradient stays with the strategy: nothing moves
    torch.testing.assert_close(p.detach(), before, rtol=0, atol=0)


def test_null_offload_loads_states_into_the_live_tensors() -> None:
    off = NoOptimizerOffload()
    p, opt = _optimizer()
    live = opt.state[p]["exp_avg"]
    off.load_state(opt, p, {"exp_avg": torch.full((4,), 3.0), "extra": 7})
    assert opt.state[p]["exp_avg"] is live  # copied in place: the optimizer's tensor stays
    torch.testing.assert_close(live, torch.full((4,), 3.0), rtol=0, atol=0)
    assert opt.state[p]["extra"] == 7 and "exp_avg_sq" in opt.state[p]  # other entries kept
    fresh = torch.nn.Parameter(torch.zeros(2))
    off.load_state(opt, fresh, {"exp_avg": torch.ones(2)})
    torch.testing.assert_close(opt.state[fresh]["exp_avg"], torch.ones(2), rtol=0, atol=0)


def test_host_breakdown_adds_nothing_without_offload() -> None:
    p, opt = _optimizer()
    out = {"optimizer_states": 32}
    add_host_breakdown(out, NoOptimizerOffload(), opt, lambda ts: sum(t.numel() for t in ts))
    assert out == {"optimizer_states": 32}
