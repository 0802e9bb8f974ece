"""``NoOptimizerOffload``: the null optimizer offload the stage strategies hold without offload.

See [Note: optimizer offload seam]. The training trajectories without offload (the stage 1-3
parity tests) run through it; here its contract: it satisfies the protocol, owns nothing, keeps
the masters where they are, and refuses the calls that only make sense for an owned master.
"""

from __future__ import annotations

import pytest
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


@pytest.mark.parametrize(
    "call", ["stage_grad", "updated", "master_value", "set_master", "state_of", "load_state"]
)
def test_null_offload_refuses_owned_only_calls(call: str) -> None:
    off = NoOptimizerOffload()
    p, opt = _optimizer()
    args = {
        "stage_grad": (p, None),
        "updated": (p,),
        "master_value": (p,),
        "set_master": (p, torch.zeros(4)),
        "state_of": (opt, p),
        "load_state": (opt, p, {}),
    }[call]
    with pytest.raises(KeyError, match=f"NoOptimizerOffload.{call}: .*owns no master"):
        getattr(off, call)(*args)


def test_host_breakdown_adds_nothing_without_offload() -> None:
    p, opt = _optimizer()
    out = {"optimizer_states": 32}
    add_host_breakdown(out, NoOptimizerOffload(), opt, lambda ts: sum(t.numel() for t in ts))
    assert out == {"optimizer_states": 32}
