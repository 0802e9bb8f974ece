"""The autograd Functions behind the layer's memory switches, and its dropout.

[Note: transformer memory switches]
Each switch of :class:`~zero_ops.transformer.TransformerConfig` replaces one piece of the layer
with a Function that saves less for backward and recomputes the rest there:

- ``normalize_invertible`` (:class:`InvertibleLayerNorm`): a LayerNorm that saves its *output*
  (which the next matmul saves anyway, so it costs nothing) and rstd instead of its input and
  mean; backward rebuilds the normalised input as ``(y - beta) / gamma``. Saves, per LayerNorm,
  the input and the mean. Needs no zero in ``gamma`` (as DeepSpeed's invertible LayerNorm).
- ``gelu_checkpoint`` (:class:`GeluLinear`): GELU followed by the FFN output projection that
  saves only the GELU input; backward recomputes the GELU output. Saves B*S*intermediate.
- ``attn_dropout_checkpoint`` (:class:`DropoutMatmul`): attention dropout followed by the
  product with V that saves the softmax output (which softmax saves anyway) and the 1-byte keep
  mask, not the dropped probabilities; backward recomputes them. Saves B*heads*S*S.

``zero_ops.transformer.memory.stated_savings`` states these bytes and the tests measure them
with ``torch.autograd.graph.saved_tensors_hooks``.

Dropout masks are drawn exactly as ``torch.nn.functional.dropout`` draws them on CPU (a
``bernoulli_(1 - p)`` over a tensor of the input's dtype), from the global generator unless the
config sets a seed, and kept as bool (1 byte per element instead of torch's float noise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx


def keep_mask(like: torch.Tensor, p: float, generator: torch.Generator | None) -> torch.Tensor:
    """A bool mask, True where an element survives dropout with probability ``p``."""
    return torch.empty_like(like).bernoulli_(1.0 - p, generator=generator).bool()


def apply_mask(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """``x * mask / (1 - p)``; autograd saves only the bool mask for it."""
    return (x * mask).mul_(1.0 / (1.0 - p))


class InvertibleLayerNorm(torch.autograd.Function):
    """LayerNorm over the last dimension that saves its output, not its input.

    See [Note: transformer memory switches].
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
    ) -> torch.Tensor:
        y, _, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        ctx.save_for_backward(y, weight, bias, rstd)
        return y

    @staticmethod
    def backward(ctx: FunctionCtx, dy: torch.Tensor) -> tuple:
        y, weight, bias, rstd = ctx.saved_tensors
        acc = torch.promote_types(dy.dtype, torch.float32)  # reductions in float32 for half inputs
        w, b = weight.to(acc), bias.to(acc)
        dyf = dy.to(acc)
        xhat = (y.to(acc) - b) / w
        lead = tuple(range(dy.dim() - 1))
        dweight = (dyf * xhat).sum(lead).to(weight.dtype) if ctx.needs_input_grad[1] else None
        dbias = dyf.sum(lead).to(bias.dtype) if ctx.needs_input_grad[2] else None
        dx = None
        if ctx.needs_input_grad[0]:
            g = dyf * w
            mean_g = g.mean(-1, keepdim=True)
            mean_gx = (g * xhat).mean(-1, keepdim=True)
            dx = ((g - mean_g - xhat * mean_gx) * rstd.to(acc)).to(dy.dtype)
        return dx, dweight, dbias, None


class GeluLinear(torch.autograd.Function):
    """``gelu(u) @ weight.T + bias`` saving only ``u``; backward recomputes ``gelu(u)``.

    See [Note: transformer memory switches].
    """

    @staticmethod
    def forward(ctx: FunctionCtx, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        g = F.gelu(u)
        out = torch.addmm(bias, g.reshape(-1, g.shape[-1]), weight.t())
        ctx.save_for_backward(u, weight)
        return out.view(*u.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple:
        u, weight = ctx.saved_tensors
        d2 = dout.reshape(-1, dout.shape[-1])
        g = F.gelu(u).reshape(-1, u.shape[-1])
        dweight = d2.t().mm(g) if ctx.needs_input_grad[1] else None
        dbias = d2.sum(0) if ctx.needs_input_grad[2] else None
        du = None
        if ctx.needs_input_grad[0]:
            dg = d2.mm(weight).view_as(u)
            du = torch.ops.aten.gelu_backward(dg, u)
        return du, dweight, dbias


class DropoutMatmul(torch.autograd.Function):
    """``dropout(probs) @ v`` with a given keep mask, saving ``probs`` and the mask only.

    See [Note: transformer memory switches].
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx, probs: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, p: float
    ) -> torch.Tensor:
        ctx.save_for_backward(probs, v, mask)
        ctx.scale = 1.0 / (1.0 - p)
        return torch.matmul((probs * mask).mul_(ctx.scale), v)

    @staticmethod
    def backward(ctx: FunctionCtx, dctx: torch.Tensor) -> tuple:
        probs, v, mask = ctx.saved_tensors
        dprobs = dv = None
        if ctx.needs_input_grad[1]:
            dropped = (probs * mask).mul_(ctx.scale)
            dv = torch.matmul(dropped.transpose(-1, -2), dctx)
        if ctx.needs_input_grad[0]:
            dprobs = torch.matmul(dctx, v.transpose(-1, -2)).mul_(mask).mul_(ctx.scale)
        return dprobs, dv, None, None
