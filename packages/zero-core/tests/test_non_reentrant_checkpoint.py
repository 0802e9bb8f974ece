"""``zero.checkpointing.non_reentrant_checkpoint`` gives the gradients of no checkpointing and of
``checkpoint`` (issue 26), with dropout, inputs that need no grad, keyword arguments and tuple
outputs holding non-tensors; unlike ``checkpoint`` it works with ``torch.autograd.grad``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zero_core.activation_checkpointing import checkpoint, non_reentrant_checkpoint


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: float = 1.0):
        h = self.drop(torch.tanh(self.lin(x))) * mask * scale
        return h, "aux", h.sum(dim=-1)


def _run(mode: str, x_needs_grad: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(3, 6, requires_grad=x_needs_grad)
    mask = (torch.rand(3, 6) > 0.2).float()  # never needs grad
    torch.manual_seed(123)  # the dropout draws
    if mode == "plain":
        h, tag, s = block(x, mask, scale=2.0)
    elif mode == "reentrant":
        h, tag, s = checkpoint(lambda a, b: block(a, b, scale=2.0), x, mask)
    else:
        h, tag, s = non_reentrant_checkpoint(block, x, mask, scale=2.0)
    assert tag == "aux"
    (h.pow(2).sum() + s.sum()).backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    if x_needs_grad:
        grads["x"] = x.grad.clone()
    return grads, h.detach()


@pytest.mark.parametrize("x_needs_grad", [True, False])
def test_same_gradients_as_plain_and_reentrant(x_needs_grad):
    want, h_want = _run("plain", x_needs_grad)
    for mode in ("reentrant", "non_reentrant"):
        got, h = _run(mode, x_needs_grad)
        torch.testing.assert_close(h, h_want, rtol=0, atol=0, msg=mode)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=f"{mode}: {k}")


def test_autograd_grad_and_no_grad():
    torch.manual_seed(0)
    block = _Block().eval()
    x = torch.randn(2, 6, requires_grad=True)
    mask = torch.ones(2, 6)
    h, _, _ = non_reentrant_checkpoint(block, x, mask)
    (gx,) = torch.autograd.grad(h.sum(), x)
    (want,) = torch.autograd.grad(block(x, mask)[0].sum(), x)
    torch.testing.assert_close(gx, want)
    with torch.no_grad():
        h, _, _ = non_reentrant_checkpoint(block, x, mask)
    assert not h.requires_grad
    with pytest.raises(TypeError, match="'function' must be callable"):
        non_reentrant_checkpoint(3, x)
